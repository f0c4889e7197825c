"""The FlashInfer attention backend: flashinfer's MLA kernels (fa3 on Hopper) behind the backend interface.

Decode rows (any uniform q_len_per_req, causal inside the row: spec-verify is decode) run through
``BatchMLAPagedAttentionWrapper`` over the 576-wide paged latent cache: q_nope·W_kc gives the latent
query, the kernel returns a latent output, ·W_vc gives ``out``.

Prefill rows take one of two paths:

- MHA over the decompressed KV of each row, length-bounded: the row's ``seq_len`` latents (cached
  prefix + this chunk) are gathered from its pages, decompressed through W_kc / W_vc into qk-192 /
  vo-128 heads, and ``BatchPrefillWithRaggedKVCacheWrapper`` attends causally (bottom-right aligned).
  MHA is the cheaper formulation for long new prompts (192-wide scores instead of 576, no per-token
  absorption). An eager step (shapes known only now) takes it unless the absorbed path below costs
  fewer FLOPs (``MLADims.absorbed_prefill_is_cheaper``: a long cached prefix under a few new tokens,
  as a prompt that starts from the prefix cache has, whose decompression would cost more than the
  wider absorbed scores).
- the absorbed paged MLA kernel, the prefill rows as causal CSR rows. A static step (a graph key's
  buffers, possibly captured) always takes it. Its shapes depend only on the key, it reads each row's pages up
  to its length and never decompresses the prefix; graph keys hold small prefill buckets
  (graphs/keys.py), where the absorbed formulation's extra FLOPs are cheap.

Decode steps on the Triton kernel: where "auto" picks this backend (``AutoFlashInferAttentionBackend``),
decode steps of q_len 1 at any batch size, and spec-verify steps of at most ``SMALL_DECODE_TOKENS``
tokens in all (rows × q_len), run on encore's Triton decode kernel, which needs no host plan. In the
engine's step (DeepSeek-V2-Lite shape, CUDA graphs, benchmarks/bench_decode_tpot.py, H100, session 57,
steps back to back) Triton's q_len-1 step is the faster at every batch size: bs 8 × 1k 7.23 / 7.47 ms
(Triton / flashinfer), bs 64 × 1k 12.43 / 12.75, bs 64 × 8k 17.08 / 17.20 (and in session 54's H200 run,
steps one at a time: 5.56 / 6.27, 9.53 / 10.40, 13.23 / 14.19; the engine's overlapped steps with this
rule against flashinfer's, session 58, H100: 7.33 / 7.36 at bs 8, 12.14 / 12.27 at bs 64,
benchmarks/bench_overlap.py), although flashinfer's kernel alone leads from 8 tokens on
(benchmarks/bench_decode_backends.py, session 55: 8 × q1 × 1k 21.7 / 20.7 µs a layer, 64 × q1 × 8k
225.9 / 218.4). At q_len 4 Triton's 64-pair tile is slow from 8 rows on (64 × q4 × 1k 80.4 /
55.7 µs a layer; the engine's bs 64 × 8k verify step 22.49 / 18.76 ms), so larger verify steps stay on
flashinfer. The choice depends on the step's shape only, so a graph key keeps it. These steps are
counted (``triton_decode_steps``). An explicit ``attention_backend="flashinfer"`` runs every decode row
on flashinfer.

Planning needs the rows' lengths on the host (``seq_lens_cpu``); flashinfer partitions the work by
them. A step built on the device (speculative draft steps 2..k advance lengths on the GPU) has none:
it runs on the Triton backend's kernels instead, counted in ``fallback_steps``.

CUDA graphs: each static shape gets its own wrappers (``use_cuda_graph=True``, reserved metadata
buffers), re-planned before every replay; flashinfer's fa2/fa3 MLA plans keep their workspace layout
across re-plans of one shape, so a captured graph stays valid, with one exception: its planner picks
one or two CTAs a cluster (its kernel's grid) from the rows' mean query length, heads included (over
64 or not). Decode rows are uniform, so their mean is the shape's; a static step's prefill rows are
not, so the bucket's padding tokens (those past the last row) go to the plan as a row of their own
over the dummy page, after the real rows: every plan of a shape then has the same query total over
the same rows. That row's output is bucket padding, dropped like the rest. (Without it a MIXED key
replayed a step of a few short prefill rows, e.g. prompts that start from the prefix cache, after
its capture at another mean, and the layout check refused it.) ``wrapper.plan`` validates its
arguments in Python for ~0.7 ms a call (H200; its native planner takes ~0.1 ms), which at bs 1 was a
fifth of a V2-Lite decode step. So a static shape is planned through ``wrapper.plan`` once, and
every later plan calls the native planner behind it directly, uploads the plan and copies the rows'
page-table rows in (``_Replanner``, which lists what else it leaves out), checking that the plan's
layout is the one the graph captured. Where flashinfer's internals differ from what ``_Replanner``
reads, every plan takes ``wrapper.plan``, counted in ``slow_replans`` with one warning.

A plan lives in a wrapper's integer workspace (8 MiB on the device and 8 MiB of pinned host memory,
which flashinfer allocates per wrapper), read by the step's kernels: with a static plan per graph key
and step part, 130 of them at the default keys, that was ~1 GiB of each. A step holds at most one
prefill plan and one decode plan, and each replay re-plans first, in stream order; so the static plans
re-planned natively share two integer workspaces, one for prefill plans and one for decode plans
(``_PlanSpace``), moved onto them after their first ``wrapper.plan``. (H200, V2-Lite shape, the
default keys: the device memory allocated while they are prepared went from 2354 to 1330 MiB;
benchmarks/README.md, "Session 38".)
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from itertools import accumulate

import torch

from encore.backends.base import AttentionBackend, MLADims, decompress_kv
from encore.backends.dense import absorb_query, project_values
from encore.backends.host_tensors import host_tensor
from encore.backends.metadata import ForwardBatch, ForwardMode
from encore.backends.triton_backend import TritonAttentionBackend
from encore.engine.kv_cache import DUMMY_PAGE

log = logging.getLogger(__name__)

_WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace; one, shared by every wrapper
_INT_WORKSPACE_BYTES = 8 << 20  # the integer workspace flashinfer's fa2/fa3 MLA backends allocate
SMALL_DECODE_TOKENS = 4  # verify steps of at most this many tokens take the Triton kernel under "auto"
_MLA_DTYPES = (torch.float16, torch.bfloat16)


def unsupported_reason(dims: MLADims, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why flashinfer's MLA kernels cannot run this model here, or None when they can."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {str(device)!r}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"needs Hopper (sm90) or newer, got sm{major}x"
    if dtype not in _MLA_DTYPES:
        return f"runs float16/bfloat16 only, got dtype {dtype}"
    if dims.kv_lora_rank not in (128, 256, 512) or dims.qk_rope_head_dim % 64:
        return (f"needs kv_lora_rank in (128, 256, 512) and qk_rope_head_dim a multiple of 64, got "
                f"{dims.kv_lora_rank} and {dims.qk_rope_head_dim}")
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return f"flashinfer is not importable ({exc})"
    return None


@dataclass(slots=True)
class _Rows:
    """Host metadata of a set of rows over the paged cache (``_rows``); the last ``dummy_rows`` of them
    read only the dummy page and have no row in the page table."""

    qo_indptr: torch.Tensor  # [R + 1] int32, CPU
    kv_indptr: torch.Tensor  # [R + 1] int32, CPU: each row's first kv_indices entry (``_rows``' span)
    kv_len: torch.Tensor  # [R] int32, CPU
    table_pages: int  # kv_indices entries of the rows the page table holds (kv_indptr[R - dummy_rows])
    num_pages: int  # kv_indptr[-1]
    num_queries: int  # qo_indptr[-1]
    dummy_rows: int = 0


def _rows(q_lens: list[int], kv_lens: list[int], page_size: int, filler: int | None = None,
          span: int | None = None) -> _Rows:
    """Built from Python lists (``host_tensor``): it runs before every flashinfer step, and as torch ops
    on small tensors it took ~200 µs at any row count on the CI machine, as lists 15 µs for one row.
    Its work is per row, never per page: the pages themselves are gathered on the device (``_row_pages``)
    or copied there as the table holds them (``span``).
    ``filler``: a last row of that many queries over as many keys on the dummy page (module docstring).
    ``span``: each table row's pages start ``span`` entries after the row before's (the page table's
    width, for a native re-plan that reads the table as it is: ``_Replanner``) instead of right after
    its last page (CSR, as ``wrapper.plan`` requires)."""
    dummy = [] if filler is None else [filler]
    kv_lens = kv_lens + dummy
    if span is None:
        kv_indptr = list(accumulate(((n + page_size - 1) // page_size for n in kv_lens), initial=0))
    else:  # only the filler row's pages to count
        table_end = len(q_lens) * span
        kv_indptr = list(range(0, table_end + 1, span)) + [table_end + (n + page_size - 1) // page_size for n in dummy]
    qo_indptr = list(accumulate(q_lens + dummy, initial=0))
    return _Rows(host_tensor(qo_indptr, torch.int32), host_tensor(kv_indptr, torch.int32),
                 host_tensor(kv_lens, torch.int32), kv_indptr[len(q_lens)], kv_indptr[-1], qo_indptr[-1], len(dummy))


def _row_pages(page_table: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """Each row's first ``kv_indptr`` pages of ``page_table`` [R, W], concatenated, then the dummy rows'
    (DUMMY_PAGE): [num_pages] on the table's device. Gathered there, with no sync (repeat_interleave is
    told its output size): a host list of every page's index cost ~0.8 ms a step at bs 64 × 8k context
    on the CI machine."""
    device = page_table.device
    table_rows = rows.kv_len.numel() - rows.dummy_rows
    indptr = rows.kv_indptr[:table_rows + 1].to(device, non_blocking=True)
    row = torch.repeat_interleave(torch.arange(table_rows, device=device), indptr[1:] - indptr[:-1],
                                  output_size=rows.table_pages)  # [table_pages]
    pages = page_table[row, torch.arange(rows.table_pages, device=device) - indptr[row]]
    if rows.num_pages == rows.table_pages:
        return pages
    return torch.nn.functional.pad(pages, (0, rows.num_pages - rows.table_pages), value=DUMMY_PAGE)


class _PinnedUploads:
    """Around a wrapper's plan: flashinfer writes a plan into the wrapper's pinned host buffer and copies
    it to the device in stream order. With overlapped steps (engine/engine.py) the next plan may come
    before the device has run the last one's copy, so entering waits for that copy (in practice done
    long since: the device had finished the step before it) and leaving marks the new one."""

    def __init__(self) -> None:
        self._copied: torch.cuda.Event | None = None

    def __enter__(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def __exit__(self, *exc) -> None:
        self._copied = torch.cuda.Event()
        self._copied.record()


class _PlanSpace:
    """An integer workspace (device and pinned host) that static plans of one step part share: a
    step plans at most one of them, right before its replay (module docstring), and the pinned
    buffer's uploads are fenced across all of them."""

    def __init__(self, device: torch.device) -> None:
        self.int_workspace = torch.empty(_INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.pinned = torch.empty(_INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
        self.fence = _PinnedUploads()

    def adopt(self, wrapper) -> bool:
        """Points ``wrapper``'s planned backend (and the wrapper's mirrors of it) at this space's
        buffers; False, leaving it as it was, where they are not the ones flashinfer allocates."""
        backend = getattr(wrapper, "_planned_backend", None)
        names = ("_int_workspace_buffer", "_pin_memory_int_workspace_buffer")
        if any(not isinstance(b, torch.Tensor) or b.numel() != _INT_WORKSPACE_BYTES
               for b in (getattr(backend, name, None) for name in names)):
            return False
        for target in (backend, wrapper):
            target._int_workspace_buffer = self.int_workspace
            target._pin_memory_int_workspace_buffer = self.pinned
        return True


class _Replanner:
    """Re-plans a CUDA-graph wrapper that ``wrapper.plan`` has planned once, through the native planner
    that plan called (flashinfer's generated fa2/fa3 module), as ``wrapper.plan`` does minus its argument
    checks and metadata copies. The plan's layout (workspace offsets, grid) must stay the one the graph
    captured: a change raises instead of replaying a stale graph.
    Of those checks only one depends on the rows' lengths: with a causal plan whose query tile (64 or
    128 packed rows, as flashinfer's planner picks it) is not a multiple of the head count, flashinfer
    refuses lengths at which its kernel would drop a visible key. Such a plan is left to
    ``wrapper.plan`` (``__call__`` returns False); head counts of 16, 32, 64 or 128 never need it.

    What a re-plan does on the host, each part measured on an H100 host (session 59, V2-Lite's 16
    heads): the whole static plan takes 93-311 µs at bs 1-64, 349-537 µs before these shortcuts:
    - the native planner writes the plan into the pinned integer workspace (29-112 µs) and it goes to
      the device in one copy from there (12 µs). flashinfer 0.7's module proxy instead stages it
      through a new pinned tensor and a host copy (36 µs more, plus ~25 µs of Python checks);
    - the fa2/fa3 kernels read the rows' pages (``kv_indices``) and the plan, nothing else: the
      rows' indptrs and lengths are the planner's host inputs and are not copied to the device (three
      copies, ~30 µs);
    - each row's pages are read from the page table as it is, one copy of its rows, each row's span
      the table's width (``_rows``' ``span``), instead of being gathered into CSR order on the device
      (~120 µs of host for ~10 launches). The entries after the table's rows hold the dummy page for
      the filler row (``_MLAPlan``).

    ``of`` returns None where the wrapper's internals are not the ones read here (another flashinfer
    version or backend)."""

    def __init__(self, backend) -> None:
        self._plan = backend._cached_module._module.plan  # the generated planner under flashinfer 0.7's proxy
        self._float_workspace = backend._float_workspace_buffer
        self._int_workspace = backend._int_workspace_buffer
        self._pinned = backend._pin_memory_int_workspace_buffer
        self._kv_indices = backend._kv_indices_buf
        self.layout = backend._plan_info  # flashinfer's FFI array: ``==`` compares it in one native call

    @classmethod
    def of(cls, wrapper) -> _Replanner | None:
        backend = getattr(wrapper, "_planned_backend", None)
        try:
            return cls(backend)
        except (AttributeError, TypeError):
            return None

    def __call__(self, rows: _Rows, page_table: torch.Tensor, num_heads: int, head_dim_ckv: int,
                 causal: bool) -> bool:
        """Re-plans ``rows`` (laid out with the table's width as their span) over ``page_table`` [R, W], or
        returns False where ``wrapper.plan`` must check the lengths (class docstring)."""
        if causal:
            packed_per_row = rows.num_queries * num_heads // rows.kv_len.numel()
            if (128 if packed_per_row > 64 else 64) % num_heads:
                return False
        layout, staged = self._plan(self._float_workspace, self._int_workspace, self._pinned, rows.qo_indptr,
                                    rows.kv_indptr, rows.kv_len, num_heads, head_dim_ckv, causal)
        if layout != self.layout:
            raise RuntimeError(f"flashinfer's MLA plan layout changed between re-plans of one graph shape "
                               f"({tuple(self.layout)} -> {tuple(layout)}); its captured graph would be stale")
        staged = int(staged)
        self._int_workspace[:staged].copy_(self._pinned[:staged], non_blocking=True)
        self._kv_indices[:rows.table_pages].view(page_table.shape).copy_(page_table)
        return True


class _MLAPlan:
    """One BatchMLAPagedAttentionWrapper and what the next ``run`` needs. Static plans (``space``
    given) own reserved metadata buffers sized for ``rows`` rows over ``max_pages`` pages in all
    (graph-capturable); after their first plan they re-plan through a ``_Replanner`` when flashinfer
    allows it, in ``space``'s integer workspace. Their ``kv_indices`` start as the dummy page: a CSR
    plan (``wrapper.plan``) writes real pages only within its table rows' R·W entries (a row has at
    most W pages), so the entries after them, which a re-plan's filler row reads, stay the dummy page."""

    def __init__(self, workspace: torch.Tensor, rows: int | None = None, max_pages: int | None = None,
                 space: _PlanSpace | None = None) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.space = space  # None: an eager plan
        self.planned = False
        self.replanner: _Replanner | None = None
        self._fence = space.fence if space is not None else _PinnedUploads()
        self.slow_replans = 0  # static re-plans that went through wrapper.plan
        if space is None:
            self.wrapper = BatchMLAPagedAttentionWrapper(workspace)
        else:
            device = workspace.device
            self.wrapper = BatchMLAPagedAttentionWrapper(
                workspace, use_cuda_graph=True,
                qo_indptr=torch.zeros(rows + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.zeros(rows + 1, dtype=torch.int32, device=device),
                kv_indices=torch.full((max(max_pages, 1),), DUMMY_PAGE, dtype=torch.int32, device=device),
                kv_len_arr=torch.zeros(rows, dtype=torch.int32, device=device))

    def plan(self, q_lens: list[int], kv_lens: list[int], filler: int | None, page_table: torch.Tensor,
             dims: MLADims, page_size: int, causal: bool, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Rows of ``q_lens`` queries over ``kv_lens`` keys, each on its row of ``page_table`` [R, W], then
        the ``filler`` row (``_rows``)."""
        with self._fence:
            self._plan(q_lens, kv_lens, filler, page_table, dims, page_size, causal, dtype, kv_dtype)

    def _plan(self, q_lens: list[int], kv_lens: list[int], filler: int | None, page_table: torch.Tensor,
              dims: MLADims, page_size: int, causal: bool, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        from flashinfer.mla import MLAPlanMetadata

        def replan(replanner: _Replanner) -> bool:
            spans = _rows(q_lens, kv_lens, page_size, filler, span=page_table.shape[1])
            return replanner(spans, page_table, dims.num_heads, dims.kv_lora_rank, causal)

        if self.replanner is not None and replan(self.replanner):
            return
        rows = _rows(q_lens, kv_lens, page_size, filler)
        kv_indices = _row_pages(page_table, rows)  # [pages]

        def plan() -> None:
            metadata = MLAPlanMetadata.csr(qo_indptr=rows.qo_indptr, kv_indptr=rows.kv_indptr,
                                           kv_indices=kv_indices, kv_len_arr=rows.kv_len)
            self.wrapper.plan(metadata=metadata, num_heads=dims.num_heads, head_dim_ckv=dims.kv_lora_rank,
                              head_dim_kpe=dims.qk_rope_head_dim, page_size=page_size, causal=causal,
                              sm_scale=dims.softmax_scale, q_data_type=dtype, kv_data_type=kv_dtype,
                              query_layout="split", kv_cache_layout="packed")

        plan()
        if self.space is None:
            return
        if self.planned:
            self.slow_replans += 1
            return
        self.planned = True
        if _Replanner.of(self.wrapper) is None:
            _warn_slow_replans()
            return
        # Onto the shared workspace (module docstring), once the first plan's upload from the buffers
        # being dropped has run (flashinfer copies from its pinned buffer outside torch's knowledge),
        # then this plan again, there.
        torch.cuda.current_stream(self.space.int_workspace.device).synchronize()
        if self.space.adopt(self.wrapper) and not replan(_Replanner.of(self.wrapper)):
            plan()
        self.replanner = _Replanner.of(self.wrapper)  # the backend the last plan left

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
            cache: torch.Tensor, out: torch.Tensor, q_lat: torch.Tensor | None = None) -> None:
        """Absorbed MLA: q_nope [T, H, dn], q_pe [T, H, dr] -> out [T, H, dv] (``q_lat``: the latent
        query, if already computed)."""
        if q_lat is None:
            q_lat = absorb_query(q_nope, w_kc)  # [T, H, R], contiguous
        o_lat = self.wrapper.run(query=(q_lat, q_pe.contiguous()), kv_cache=cache)  # [T, H, R]
        project_values(o_lat, w_vc, out)


@functools.cache
def _warn_slow_replans() -> None:
    import flashinfer

    log.warning("flashinfer %s: its MLA wrapper's internals are not the ones encore re-plans through; every "
                "CUDA-graph step re-plans through BatchMLAPagedAttentionWrapper.plan (~0.7 ms slower a step)",
                getattr(flashinfer, "__version__", "(unknown version)"))


@dataclass(slots=True)
class _RaggedPrefill:
    """The eager prefill plan: the latent slots each row gathers (``self._ragged`` holds the plan)."""

    slots: torch.Tensor  # [S] int64 on the device: cache slots of each row's positions 0 .. seq_len - 1
    num_tokens: int  # real prefill tokens (qo_indptr[num_extends])


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_spec_as_decode = True
    supports_nonuniform_decode = False  # the scheduler's decode rows are uniform; graphs need it
    graph_modes = frozenset({ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND})

    def __init__(self, kv_caches: list[torch.Tensor], dims: MLADims) -> None:
        super().__init__(kv_caches, dims)
        device = kv_caches[0].device
        reason = unsupported_reason(dims, kv_caches[0].dtype, device)
        if reason is not None:
            raise ValueError(f"attention_backend 'flashinfer' {reason}")
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._ragged = BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self._ragged_fence = _PinnedUploads()
        self._eager_decode_mla = _MLAPlan(self.workspace)
        self._eager_prefill_mla = _MLAPlan(self.workspace)
        self._spaces: dict[str, _PlanSpace] = {}  # "prefill" / "decode": the static plans' shared workspaces
        self._static: dict[tuple, _MLAPlan] = {}
        self._device_planned = TritonAttentionBackend(kv_caches, dims)
        self._prefill: _MLAPlan | _RaggedPrefill | None = None
        self._decode: _MLAPlan | None = None  # None: the planned step's decode rows run on the Triton kernel
        self._on_device = False
        self._triton_decode_steps = 0

    def warm_up_decode(self, q_len: int) -> int:
        # The Triton kernel takes device-planned steps and the decode steps "auto" routes to it.
        return self._device_planned.warm_up_decode(q_len)

    def plan(self, batch: ForwardBatch, static: bool = False) -> None:
        self._on_device = not batch.seq_lens_cpu
        if self._on_device:
            self.fallback_steps += 1
            self._device_planned.plan(batch, static)
            return
        E, page_size = batch.num_extends, batch.page_size
        width = batch.page_table.shape[1]
        seq, prefix = batch.seq_lens_cpu, batch.prefix_lens_cpu
        dtype = self.kv_caches[0].dtype
        # A static plan per step shape (the graph key's fields) and table width: its buffers are the
        # ones captured into that key's graph.
        shape = (E, batch.q_len_per_req, batch.bs, batch.num_tokens)
        self._prefill = None
        if E:
            q_lens = [s - p for s, p in zip(seq[:E], prefix[:E])]
            if static or self.absorbs_prefill(q_lens, prefix[:E]):
                filler = None  # a static plan: the bucket's padding as a last row (module docstring)
                if static:
                    tokens = batch.num_extend_tokens
                    filler = tokens - sum(q_lens)
                    plan = self._static_plan(("prefill", *shape), E + 1, E * width + -(-tokens // page_size), width)
                else:
                    plan = self._eager_prefill_mla
                plan.plan(q_lens, seq[:E], filler, batch.page_table[:E], self.dims, page_size, True, dtype, dtype)
                self._prefill = plan
            else:
                self._prefill = self._plan_ragged(batch, q_lens)
        self._decode = None
        if batch.num_decodes and self.decode_on_triton(batch.num_decodes, batch.q_len_per_req):
            self._triton_decode_steps += 1
        elif batch.num_decodes:
            rows, q = batch.num_decodes, batch.q_len_per_req
            plan = (self._static_plan(("decode", *shape), rows, rows * width, width) if static
                    else self._eager_decode_mla)
            plan.plan([q] * rows, seq[E:], None, batch.page_table[E:], self.dims, page_size, q > 1, dtype, dtype)
            self._decode = plan

    def decode_on_triton(self, rows: int, q_len: int) -> bool:
        """Whether a step's decode rows run on the Triton kernel (module docstring): never here."""
        return False

    def absorbs_prefill(self, q_lens: list[int], prefix_lens: list[int]) -> bool:
        """The eager prefill path (module docstring): absorbed where it costs fewer FLOPs than MHA."""
        return self.dims.absorbed_prefill_is_cheaper(q_lens, prefix_lens)

    @property
    def slow_replans(self) -> int:
        return sum(plan.slow_replans for plan in self._static.values())

    @property
    def triton_decode_steps(self) -> int:
        return self._triton_decode_steps

    def _static_plan(self, key: tuple, rows: int, max_pages: int, width: int) -> _MLAPlan:
        plan = self._static.get(key + (width,))
        if plan is None:
            part = key[0]  # "prefill" or "decode": a step plans at most one of each
            space = self._spaces.get(part)
            if space is None:
                space = self._spaces[part] = _PlanSpace(self.workspace.device)
            plan = self._static[key + (width,)] = _MLAPlan(self.workspace, rows, max_pages, space)
        return plan

    def _plan_ragged(self, batch: ForwardBatch, q_lens: list[int]) -> _RaggedPrefill:
        E, page_size = batch.num_extends, batch.page_size
        seq = batch.seq_lens_cpu[:E]
        heads = self.dims.num_heads
        kv_len = torch.tensor(seq, dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(E), kv_len)  # [S]
        starts = torch.zeros(E, dtype=torch.int64)
        torch.cumsum(kv_len[:-1], 0, out=starts[1:])
        pos = torch.arange(row.numel()) - torch.repeat_interleave(starts, kv_len)  # [S]
        device = batch.page_table.device
        row_d, pos_d = row.to(device, non_blocking=True), pos.to(device, non_blocking=True)
        slots = batch.page_table[row_d, pos_d // page_size].long() * page_size + pos_d % page_size  # [S]
        qo_indptr = torch.zeros(E + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
        kv_indptr = torch.zeros(E + 1, dtype=torch.int32)
        torch.cumsum(kv_len.int(), 0, out=kv_indptr[1:])
        with self._ragged_fence:
            self._ragged.plan(qo_indptr, kv_indptr, num_qo_heads=heads, num_kv_heads=heads,
                              head_dim_qk=self.dims.qk_nope_head_dim + self.dims.qk_rope_head_dim,
                              head_dim_vo=self.dims.v_head_dim, causal=True, sm_scale=self.dims.softmax_scale,
                              q_data_type=self.kv_caches[0].dtype)
        return _RaggedPrefill(slots, int(qo_indptr[-1]))

    def prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch) -> None:
        if self._on_device:
            self._device_planned.prefill(q_nope, q_pe, w_kc, w_vc, cache, out, batch)
            return
        plan = self._prefill
        if isinstance(plan, _MLAPlan):
            # Tokens past the last row's range are bucket padding the kernel leaves unwritten: keep
            # them finite (base.AttentionBackend.prefill) with a masked fill, static in shape.
            plan.run(q_nope, q_pe, w_kc, w_vc, cache, out)  # [n, H, dv]
            padding = torch.arange(out.shape[0], device=out.device) >= batch.qo_indptr[batch.num_extends]  # [n]
            out.masked_fill_(padding[:, None, None], 0)
            return
        kv = cache.view(-1, cache.shape[-1])[plan.slots].to(q_nope.dtype)  # [S, R + dr]
        k, v = decompress_kv(kv, w_kc, w_vc, self.dims.kv_lora_rank)  # [S, H, dn + dr], [S, H, dv]
        n = plan.num_tokens
        q = torch.cat([q_nope[:n], q_pe[:n]], dim=-1)  # [n, H, dn + dr]
        out[n:].zero_()
        self._ragged.run(q, k, v, out=out[:n])

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
               cache: torch.Tensor, out: torch.Tensor, batch: ForwardBatch, q_lat: torch.Tensor | None = None) -> None:
        if self._on_device or self._decode is None:  # planned on the device, or routed to the Triton kernel
            self._device_planned.decode(q_nope, q_pe, w_kc, w_vc, cache, out, batch, q_lat)
            return
        self._decode.run(q_nope, q_pe, w_kc, w_vc, cache, out, q_lat)


class AutoFlashInferAttentionBackend(FlashInferAttentionBackend):
    """What "auto" runs where flashinfer takes the model: q_len-1 decode steps and small verify steps on
    the Triton kernel (module docstring)."""

    def decode_on_triton(self, rows: int, q_len: int) -> bool:
        return q_len == 1 or rows * q_len <= SMALL_DECODE_TOKENS
