"""The FlashInfer backend against the torch reference (GPU only: flashinfer's MLA kernels need sm90).

Tolerance: bf16 inputs and caches, float32 reference; relative error per token ≤ 2e-2 (TOL), the
spread bf16 rounding of q, the cache and the two absorption GEMMs gives (the Triton backend passes the
same bound).
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import LAYOUTS, TOL, check_against_torch, make_step, max_rel_error, real_tokens, run_backend

from encore.backends.base import MLADims
from encore.backends.context import StepContext
from encore.backends.mla_ops import latent_attention
from encore.backends.torch_backend import TorchAttentionBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# DeepSeek-V2-Lite's attention (16 heads; qk 192 / vo 128 for the MHA prefill; 512 + 64 latent).
DIMS = MLADims(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
               softmax_scale=192 ** -0.5)
SPEC_LAYOUTS = {f"verify-q{q}": ([], [q, 9 + q, 70, 130], q) for q in (2, 3, 4)}


def backend_cls(auto: bool = False):
    """The backend an explicit "flashinfer" names (flashinfer's kernels for every row), or "auto"'s."""
    from encore.backends.flashinfer_backend import AutoFlashInferAttentionBackend, FlashInferAttentionBackend

    return AutoFlashInferAttentionBackend if auto else FlashInferAttentionBackend


@pytest.mark.parametrize("static", [False, True], ids=["eager-plan", "static-plan"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS) + list(SPEC_LAYOUTS))
def test_matches_torch(layout, page_size, static):
    case = LAYOUTS.get(layout) or SPEC_LAYOUTS[layout]
    check_against_torch(backend_cls(), *case, page_size, torch.bfloat16, DIMS, static)


@pytest.mark.parametrize("static", [False, True], ids=["eager-plan", "static-plan"])
@pytest.mark.parametrize("case", [([], [16384, 17000], 1), ([], [16384, 20000], 4), ([(16000, 300)], [16500], 1)],
                         ids=["decode-16k", "verify-q4-16k", "mixed-prefix-16k"])
def test_long_context(case, static):
    check_against_torch(backend_cls(), *case, 64, torch.bfloat16, DIMS, static)


def test_device_planned_steps_take_the_triton_kernels():
    """A step with no host lengths (speculative draft steps built on the GPU) cannot be planned by
    flashinfer: it runs on the Triton kernels, counted, and still matches the reference."""
    batch, cache, inputs = make_step([], [5, 40, 77], 1, 16, torch.bfloat16, DIMS)
    batch.seq_lens_cpu, batch.prefix_lens_cpu = [], []
    caches = [cache.clone()]
    backend = backend_cls()(caches, DIMS)
    backend.plan(batch)
    with StepContext(backend).bind(batch):
        got = latent_attention(*inputs, caches[0])
    want, _ = run_backend(TorchAttentionBackend, batch, cache, inputs, DIMS)
    assert backend.fallback_steps == 1
    assert max_rel_error(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("static", [False, True], ids=["eager-plan", "static-plan"])
@pytest.mark.parametrize("case, on_triton", [
    (([], [1, 5, 40, 77], 1), True),  # q_len 1
    (([], [1, 5, 40, 77, 90, 300, 7, 12, 64], 1), True),
    (([], [9, 300], 2), True),  # 4 tokens
    (([], [20000], 4), True),
    (([(3, 9), (0, 5)], [1, 17, 50, 33, 8], 1), True),  # a MIXED step's decode rows; its prefill rows stay on flashinfer
    (([], [9, 300], 3), False),  # 6 tokens
    (([], [9, 300, 40, 2], 2), False),
    (([(3, 9)], [5, 17, 50], 2), False),
    (([(3, 9)], [], 1), False),  # no decode rows
], ids=["q1x4", "q1x9", "q2x2", "q4x1-20k", "mixed-q1x5", "q3x2", "q2x4", "mixed-q2x3", "prefill-only"])
def test_auto_runs_decode_and_small_verify_steps_on_the_triton_kernel(case, on_triton, static):
    """Under "auto", q_len-1 decode rows and verify rows of at most SMALL_DECODE_TOKENS tokens take the
    Triton kernel (faster there), counted, with no flashinfer decode plan; larger verify steps take
    flashinfer. Both match the reference."""
    batch = check_against_torch(backend_cls(auto=True), *case, 16, torch.bfloat16, DIMS, static)
    cache = torch.zeros(1, 16, DIMS.latent_dim, dtype=torch.bfloat16, device="cuda")
    for auto in (True, False):
        backend = backend_cls(auto)([cache], DIMS)
        backend.plan(batch, static)
        routed = auto and on_triton
        assert backend.triton_decode_steps == int(routed)
        assert (backend._decode is None) == (routed or not batch.num_decodes)


def load(static, step) -> None:
    """``step``'s rows into the static step whose buffers a captured graph reads."""
    for name in ("seq_lens", "prefix_lens", "qo_indptr", "positions", "slot_mapping"):
        getattr(static, name).copy_(getattr(step, name))
    static.page_table.zero_()
    static.page_table[:, :step.page_table.shape[1]].copy_(step.page_table)
    static.seq_lens_cpu, static.prefix_lens_cpu = step.seq_lens_cpu, step.prefix_lens_cpu


@pytest.mark.parametrize("replan", ["native", "wrapper"])
@pytest.mark.parametrize("layout", ["decode-q1", "mixed-q3"])
def test_static_plan_replays_in_a_cuda_graph(layout, replan, monkeypatch):
    """Capture once, then re-plan and replay on other lengths and pages in the same buffers: the replay
    matches the reference on the new step (flashinfer keeps a shape's workspace layout across plans).
    The re-plan goes through the native planner directly (``_Replanner``), or, where that is not
    available, through ``wrapper.plan``, counted in ``slow_replans``."""
    from encore.backends import flashinfer_backend

    if replan == "wrapper":
        monkeypatch.setattr(flashinfer_backend._Replanner, "of", classmethod(lambda cls, wrapper: None))
    extends, decodes, q_len = LAYOUTS[layout]
    first = make_step(extends, decodes, q_len, 16, torch.bfloat16, DIMS, seed=1)[0]
    grown = [(p + 3, n) for p, n in extends], [s + 25 for s in decodes]
    second, cache, inputs = make_step(*grown, q_len, 16, torch.bfloat16, DIMS, seed=2)  # the larger cache
    width = max(first.page_table.shape[1], second.page_table.shape[1])
    static = make_step(*grown, q_len, 16, torch.bfloat16, DIMS, seed=2)[0]
    static.page_table = torch.zeros(static.bs, width, dtype=torch.int32, device="cuda")
    caches = [cache.clone()]
    backend = backend_cls()(caches, DIMS)
    context = StepContext(backend)

    assert first.num_tokens == second.num_tokens
    load(static, first)
    with context.bind(static):
        backend.plan(static, static=True)
        latent_attention(*inputs, caches[0])  # warm-up: JIT and workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = latent_attention(*inputs, caches[0])
    load(static, second)
    with context.bind(static):
        backend.plan(static, static=True)
        graph.replay()
    want, _ = run_backend(TorchAttentionBackend, second, caches[0], inputs, DIMS)
    keep = real_tokens(second)
    assert max_rel_error(out[keep], want[keep]) < TOL[torch.bfloat16]
    plans = list(backend._static.values())
    assert all((plan.replanner is not None) == (replan == "native") for plan in plans)
    assert backend.slow_replans == (0 if replan == "native" else len(plans))


def test_static_plans_share_a_workspace_per_step_part_and_replay_in_turns():
    """A step plans at most one prefill and one decode plan, each right before its replay, so the
    static plans re-planned natively share one integer workspace for decode rows and one for prefill
    rows (flashinfer allocates 8 MiB of device and of pinned memory per wrapper). Two shapes whose
    decode plans share one, each captured in a CUDA graph, then re-planned and replayed in turns on
    other lengths: every replay matches the reference, the one after the other shape's re-plan too."""
    backend = context = None
    shapes = []
    for layout, seed in (("decode-q1", 2), ("mixed-q3", 4)):
        extends, decodes, q_len = LAYOUTS[layout]
        first = make_step(extends, decodes, q_len, 16, torch.bfloat16, DIMS, seed=seed - 1)[0]
        grown = [(p + 3, n) for p, n in extends], [s + 25 for s in decodes]
        second, cache, inputs = make_step(*grown, q_len, 16, torch.bfloat16, DIMS, seed=seed)
        static = make_step(*grown, q_len, 16, torch.bfloat16, DIMS, seed=seed)[0]
        static.page_table = torch.zeros(static.bs, max(first.page_table.shape[1], second.page_table.shape[1]),
                                        dtype=torch.int32, device="cuda")
        if backend is None:
            backend = backend_cls()([cache.clone()], DIMS)
            context = StepContext(backend)
        load(static, first)
        with context.bind(static):
            backend.plan(static, static=True)
            latent_attention(*inputs, cache)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = latent_attention(*inputs, cache)
        shapes.append((static, second, cache, inputs, graph, out))
    plans = backend._static
    assert len(plans) == 3 and all(plan.replanner is not None for plan in plans.values())
    workspaces = {part: {plan.wrapper._int_workspace_buffer.data_ptr() for key, plan in plans.items() if key[0] == part}
                  for part in ("decode", "prefill")}
    assert len(workspaces["decode"]) == len(workspaces["prefill"]) == 1
    assert workspaces["decode"] != workspaces["prefill"]
    wants = {}
    for i in (0, 1, 0, 1):
        static, second, cache, inputs, graph, out = shapes[i]
        load(static, second)
        with context.bind(static):
            backend.plan(static, static=True)
            graph.replay()
        if i not in wants:  # the reference reads the cache as the replay left it (it writes the step's latents)
            wants[i] = run_backend(TorchAttentionBackend, second, cache, inputs, DIMS)[0]
        want = wants[i]
        keep = real_tokens(second)
        assert max_rel_error(out[keep], want[keep]) < TOL[torch.bfloat16]
    assert backend.slow_replans == 0


def test_static_prefill_plans_keep_their_layout_whatever_the_rows_query_lengths():
    """flashinfer picks its grid from the rows' mean query length, heads included: one static shape's
    prefill row planned at 30 new tokens (480 packed rows) and then at 3 (48, e.g. a prompt that starts
    from the prefix cache) in the same bucket must keep the layout its graph captured. Without the
    bucket's padding as a row of its own the second plan raised "plan layout changed"."""
    batch, cache, _ = make_step([(0, 30)], [40], 1, 16, torch.bfloat16, DIMS)
    backend = backend_cls()([cache.clone()], DIMS)
    backend.plan(batch, static=True)
    batch.prefix_lens_cpu = [27, *batch.prefix_lens_cpu[1:]]
    backend.plan(batch, static=True)
    assert backend.slow_replans == 0 and all(plan.replanner is not None for plan in backend._static.values())


def test_a_native_replan_whose_layout_changed_raises():
    """The native re-plan checks that the plan keeps the layout a captured graph was built on: a
    different one raises instead of replaying a stale graph."""
    batch, cache, _ = make_step([], [5, 40, 77], 1, 16, torch.bfloat16, DIMS)
    backend = backend_cls()([cache.clone()], DIMS)
    backend.plan(batch, static=True)
    (plan,) = backend._static.values()
    plan.replanner.layout = ()  # as if the first plan had laid the workspace out otherwise
    with pytest.raises(RuntimeError, match="plan layout changed"):
        backend.plan(batch, static=True)


GAP = 0.05  # logprob gap between the reference's top two tokens below which bf16 kernels may pick either


def test_engine_greedy_matches_the_torch_backend(tmp_path):
    """End to end with CUDA graphs (DECODE, MIXED and EXTEND keys, padding included) on a tiny V2-Lite
    checkpoint with DeepSeek's attention widths, bf16 on both sides. Greedy tokens must agree before
    the first position where the torch reference's top-two logprobs are within GAP (a near tie that
    bf16 rounding differences between kernels may flip; from there the sequences may legitimately
    part). This random checkpoint's distributions are flat, so ties come early: at least two tokens a
    prompt on average must be compared (the prefill's and a graph-replayed decode step's)."""
    from checkpoints import write_checkpoint

    from encore.engine import Engine, SamplingParams

    model = write_checkpoint("v2_lite", tmp_path, overrides=dict(kv_lora_rank=128, qk_nope_head_dim=128,
                                                                 qk_rope_head_dim=64, v_head_dim=128))
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "x" * 70, [5, 9, 40]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    options = dict(model=str(model), device="cuda", dtype="bfloat16", max_model_len=256,
                   graph_decode_sizes=(1, 2, 4, 8), graph_mixed_decode_sizes=(4,), graph_prefill_tokens=(64,))
    want = Engine(attention_backend="torch", compile=False, cuda_graphs=False, **options).generate(prompts, params)
    engine = Engine(**options)
    assert engine.runner.backend.name == "flashinfer"  # "auto" picks it for these widths in bf16
    got = engine.generate(prompts, params)
    compared = 0
    for ref, out in zip(want, got):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in ref.logprobs]
        exact = next((i for i, gap in enumerate(gaps) if gap < GAP), len(gaps))  # up to the first near tie
        assert out.token_ids[:exact] == ref.token_ids[:exact], (ref.token_ids, out.token_ids, gaps)
        compared += exact
    assert compared >= 2 * len(prompts), compared
    stats = engine.stats()
    assert stats["graph_replays"] > 0 and stats["attention_fallback_steps"] == 0, stats
    assert stats["attention_slow_replans"] == 0, stats
    assert stats["attention_triton_decode_steps"] > 0, stats  # the q_len-1 decode steps
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
