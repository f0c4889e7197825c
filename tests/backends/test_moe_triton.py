"""The Triton fused MoE (alignment and kernels) against the reference ``experts_torch``, and the
Triton expert selection against ``select_experts``.

Without CUDA the kernels run in Triton's interpreter, on tiny shapes; TRITON_INTERPRET must be set
before triton is first imported, so when another module imported it first the CPU tests skip and
run again in a child process (``triton_interpreter.py`` says why). The interpreter's
bfloat16 dot is wrong, so CPU tests use float32 and float16; the GPU tests (``-m gpu``) cover
bfloat16, CUDA-graph replay, the op's dispatch and DeepSeek's real shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_interpreter import in_process, rerun_in_child  # before anything imports triton

from encore.backends.moe import FUSED_MOE_MAX_PAIRS, experts_grouped, experts_torch, select_experts
from encore.backends.moe_triton import (
    FusedMoEConfig, OneTokenConfig, align_pairs, config_token_counts, default_config, fused_moe, max_blocks,
    one_token_moe)
from encore.backends.routing_triton import select_experts_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = FusedMoEConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)  # several N and K tiles
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def routing(tokens: int, experts: int, k: int, gen: torch.Generator, spread: int | None = None) -> torch.Tensor:
    """ids [T, k] int64: k distinct experts per token, drawn from the first ``spread`` experts (all of
    them by default), so tokens share experts and some experts get none."""
    pool = spread or experts
    return torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(tokens)]).to(DEVICE)


def inputs(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype = torch.float32,
           seed: int = 0, spread: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    weights = torch.rand(tokens, k, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(DEVICE), routing(tokens, experts, k, gen, spread)


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-token relative error (norms over H)."""
    diff = (out.float() - ref.float()).norm(dim=1)
    return (diff / ref.float().norm(dim=1).clamp_min(1e-6)).max().item()


# ---------------------------------------------------------------- alignment (CPU: interpreter)

def expected_alignment(ids: torch.Tensor, experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The layout align_pairs promises, built in Python: experts in order, each one's pairs in pair
    order padded with the sentinel to whole blocks, then sentinel blocks of expert -1 up to the bound."""
    flat = ids.flatten().tolist()
    sentinel, blocks = len(flat), max_blocks(len(flat), experts, block_m)
    slots, block_expert = [], []
    for expert in range(experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        used = -(-len(pairs) // block_m)
        slots += pairs + [sentinel] * (used * block_m - len(pairs))
        block_expert += [expert] * used
    block_expert += [-1] * (blocks - len(block_expert))
    return slots + [sentinel] * (blocks * block_m - len(slots)), block_expert


@in_process
@pytest.mark.parametrize("chunk", [64, 2048])  # 64: the counts and ranks carried across chunks
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("tokens, experts, k, spread", [
    (1, 8, 2, None),  # six experts get no token
    (3, 8, 2, None),
    (17, 8, 2, None),  # experts repeat across tokens; several blocks per expert at block_m 4
    (17, 8, 1, 1),  # every token on expert 0
    (5, 16, 3, 3),  # experts 3..15 get none
    (150, 64, 3, None),  # 450 pairs
    (40, 66, 8, None),  # V2-Lite's 64 routed + 2 fused shared experts: bins past E in the histogram
])
def test_align_pairs_layout(tokens, experts, k, spread, block_m, chunk):
    gen = torch.Generator().manual_seed(tokens)
    ids = routing(tokens, experts, k, gen, spread)
    sorted_pairs, block_expert = align_pairs(ids, experts, block_m, chunk)
    want_slots, want_blocks = expected_alignment(ids.cpu(), experts, block_m)
    assert block_expert.tolist() == want_blocks
    assert sorted_pairs.tolist() == want_slots
    # The properties the kernels rely on, stated directly.
    real = sorted_pairs[sorted_pairs < ids.numel()].long()
    assert sorted(real.tolist()) == list(range(ids.numel()))  # every pair exactly once
    owner = block_expert.repeat_interleave(block_m)[sorted_pairs < ids.numel()]
    assert torch.equal(ids.flatten()[real].int(), owner)  # each pair in a block of its expert


@in_process
def test_align_pairs_bound_is_tight():
    # One token, k distinct experts: k blocks of one pair each, exactly the bound — no spare program.
    ids = torch.tensor([[5, 0, 7]], device=DEVICE)
    sorted_pairs, block_expert = align_pairs(ids, 8, 16)
    assert block_expert.tolist() == [0, 5, 7]
    assert sorted_pairs.view(3, 16)[:, 0].tolist() == [1, 0, 2]


# ---------------------------------------------------------------- fused MoE (CPU: interpreter)

@in_process
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small-tiles"])
@pytest.mark.parametrize("tokens, experts, k, spread", [
    (1, 8, 2, None), (3, 8, 2, None), (17, 8, 2, None), (17, 8, 1, 1), (17, 8, 3, 4), (5, 16, 4, None)])
def test_fused_moe_matches_reference(tokens, experts, k, spread, config):
    x, w13, w2, weights, ids = inputs(tokens, experts, k, 64, 48, spread=spread)
    out = fused_moe(x, w13, w2, weights, ids, config=config)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert max_rel_error(out, experts_torch(x, w13, w2, weights, ids)) <= 1e-5


@in_process
@pytest.mark.parametrize("hidden, inter", [(64, 48), (72, 40)])  # K and N tails that do not fill a tile
def test_one_token_moe_matches_reference(hidden, inter):
    x, w13, w2, weights, ids = inputs(1, 8, 3, hidden, inter, seed=hidden)
    config = OneTokenConfig(gate_n=16, down_n=16)  # several programs each (a tile holds all of K)
    ref = experts_torch(x, w13, w2, weights, ids)
    assert max_rel_error(one_token_moe(x, w13, w2, weights, ids, config=config), ref) <= 1e-5


@in_process
@pytest.mark.parametrize("shared", [1, 2])
def test_one_token_fused_shared_experts(shared):
    """num_shared = S: the token's last S pairs are experts E - S..E - 1 with weight 1, which the gate_up
    kernel takes without reading ids; a wrong expert there would change the output."""
    x, w13, w2, weights, ids = inputs(1, 8, 3 + shared, 64, 48, seed=shared, spread=8 - shared)
    ids[:, 3:] = torch.arange(8 - shared, 8, device=DEVICE)
    weights[:, 3:] = 1.0
    ref = experts_torch(x, w13, w2, weights, ids)
    assert max_rel_error(fused_moe(x, w13, w2, weights, ids, num_shared=shared), ref) <= 1e-5


@in_process
def test_one_token_goes_through_the_one_token_kernels(monkeypatch):
    import encore.backends.moe_triton as moe_triton

    def no_alignment(*args):
        raise AssertionError("one token was aligned into blocks")

    def no_sum_launch(*args):
        raise AssertionError("one token's pairs were summed by a launch of their own")

    x, w13, w2, weights, ids = inputs(1, 8, 2, 64, 48)
    monkeypatch.setattr(moe_triton, "align_pairs", no_alignment)
    monkeypatch.setattr(moe_triton, "_sum_pairs", no_sum_launch)
    assert max_rel_error(fused_moe(x, w13, w2, weights, ids), experts_torch(x, w13, w2, weights, ids)) <= 1e-5
    with pytest.raises(AssertionError, match="aligned into blocks"):  # a config asks for the blocked kernels
        fused_moe(x, w13, w2, weights, ids, config=SMALL)


def test_one_token_kernels_compile_to_whole_vector_rows():
    """The one-token kernels at V2-Lite's and V3's layers hold their weight rows in registers as 16-byte
    loads (no 2-byte loads, nothing spilled; at V2-Lite down at most 128 registers a thread, four programs
    an SM, so that its 512 programs run in one wave, and gate_up at most 168, three programs an SM:
    Triton 3.6, the GPU machine's, gives it 167 and 3.9 127, and forcing 128 on 3.6 made the step 36 µs
    slower, benchmarks/README.md "Session 50"), and down issues its second pair's tile before its first
    reduction (without the prefetch it issued one pair's tile at a time); the expert selection without a
    bias skips each pick's gather. sm90 SASS from Triton's own ptxas, no GPU needed (moe_sass.py, in a
    child process without the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("moe_sass.py"))], env=env,
                           capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-3000:]
    found = json.loads(child.stdout)
    for key, kernel in found.items():
        assert kernel["local"] == 0 and not any("U16" in op for op in kernel["loads"]), (key, kernel)
        if key.endswith("v2-lite"):
            assert kernel["registers"] <= (128 if key.startswith("down") else 168), (key, kernel)
        if key.startswith("down"):
            assert kernel["vector_loads_before_reduction"] >= kernel["tile_vector_loads"] * 3 // 2, (key, kernel)
    # Without a bias the choice is the score, and each of the 6 picks takes its weight from the maximum it
    # found: one 5-shuffle reduction fewer a pick than with the bias, where the weight is gathered.
    assert found["selection,v2-lite"]["shuffles"] <= found["selection,v2-lite-bias"]["shuffles"] - 6 * 5


@in_process
def test_fused_moe_float16_and_strided_x():
    x, w13, w2, weights, ids = inputs(9, 8, 2, 64, 48, dtype=torch.float16)
    wide = torch.zeros(9, 80, dtype=torch.float16, device=DEVICE)
    wide[:, :64] = x
    out = fused_moe(wide[:, :64], w13, w2, weights, ids, config=SMALL)  # rows 80 apart
    assert max_rel_error(out, experts_torch(x.float(), w13.float(), w2.float(), weights, ids)) <= 2e-3


@in_process
def test_fused_moe_no_tokens():
    _, w13, w2, _, _ = inputs(1, 8, 2, 64, 48)
    x, weights = torch.empty(0, 64, device=DEVICE), torch.empty(0, 2, device=DEVICE)
    assert fused_moe(x, w13, w2, weights, torch.empty(0, 2, dtype=torch.int64, device=DEVICE)).shape == (0, 64)


@in_process
def test_fused_moe_rejects_bad_inputs():
    x, w13, w2, weights, ids = inputs(3, 8, 2, 64, 48)
    with pytest.raises(ValueError, match="ids"):
        fused_moe(x, w13, w2, weights, ids.int())
    with pytest.raises(ValueError, match="weights"):
        fused_moe(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2.transpose(1, 2).contiguous(), weights, ids)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, w13[:, :, :32], w2, weights, ids)
    with pytest.raises(ValueError, match="dtypes differ"):
        fused_moe(x.half(), w13, w2, weights, ids)
    for bad in (-1, 2):  # no routed pair would be left at 2
        with pytest.raises(ValueError, match=f"num_shared={bad}"):
            fused_moe(x, w13, w2, weights, ids, num_shared=bad)
    with pytest.raises(ValueError, match="block_k=24"):
        FusedMoEConfig(block_m=16, block_n=32, block_k=24, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="align_chunk=24"):
        FusedMoEConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, align_chunk=24)
    for bad, field in ((dict(gate_n=3), "gate_n=3"), (dict(down_n=3), "down_n=3"), (dict(num_warps=3), "num_warps=3")):
        with pytest.raises(ValueError, match=field):  # the one-token config names its own field
            OneTokenConfig(**{**dict(gate_n=4, down_n=4), **bad})


def test_default_config_by_tokens_and_dtype():
    blocks = [default_config(tokens, torch.bfloat16).block_m for tokens in (1, 64, 128, 129, 4096)]
    assert blocks == sorted(blocks) and blocks[0] == 16 and blocks[-1] > 16  # larger blocks for larger batches
    assert default_config(64, torch.float32).block_k == default_config(64, torch.bfloat16).block_k // 2


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 100, 128, 129, 300, 512, 513, 8192])
def test_config_token_counts_reach_every_config_once(max_tokens):
    """The warm-up's token counts: 1 for the one-token kernels, then one per config of the blocked
    kernels that a step of 2 to max_tokens tokens can use."""
    counts = config_token_counts(max_tokens)
    assert counts[0] == 1 and max(counts) <= max_tokens
    used = [default_config(tokens, torch.bfloat16) for tokens in counts[1:]]
    assert len(set(used)) == len(used)  # no config twice
    assert set(used) == {default_config(tokens, torch.bfloat16) for tokens in range(2, max_tokens + 1)}


# ---------------------------------------------------------------- expert selection (CPU: interpreter)

# (top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor, experts, bias)
ROUTINGS = {
    "v2-lite": (6, "softmax", "greedy", 1, 1, False, 1.0, 64, False),
    "v2": (6, "softmax", "group_limited_greedy", 8, 3, False, 16.0, 160, False),
    "v2-renorm": (6, "softmax", "greedy", 1, 1, True, 1.0, 64, False),
    "v3": (8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, 256, True),
    "kimi-k2": (8, "sigmoid", "noaux_tc", 1, 1, True, 2.827, 384, True),
    "encore-tiny": (2, "sigmoid", "noaux_tc", 4, 2, True, 2.5, 16, True),
    "sigmoid-plain": (3, "sigmoid", "greedy", 1, 1, False, 1.5, 24, True),
}


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids, weights) ordered by expert id: the reference's top-k order is unspecified."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def routing_case(name: str, tokens: int, seed: int = 0):
    k, scoring, method, groups, top_groups, norm, scale, experts, has_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(DEVICE)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE) if has_bias else None
    return logits, bias, (k, scoring, method, groups, top_groups, norm, scale)


@in_process
@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_select_experts_matches_reference(name, tokens):
    """Same experts and weights as ``select_experts`` (softmax / sigmoid, bias, max or top-2 group
    scores, renormalized or scaled), ids best first, over rows that span several programs."""
    logits, bias, params = routing_case(name, tokens)
    weights, ids = select_experts_triton(logits, bias, *params)
    want_weights, want_ids = by_expert(*select_experts(logits, bias, *params))
    got_weights, got_ids = by_expert(weights, ids)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)
    choice = logits.softmax(-1) if params[1] == "softmax" else logits.sigmoid()
    if bias is not None:
        choice = choice + bias
    ranked = choice.gather(1, ids)
    assert (ranked[:, :-1] >= ranked[:, 1:]).all()  # best first


@in_process
def test_select_experts_edge_rows():
    """No tokens: empty outputs. A NaN row still names experts that exist (the MoE kernels index
    weights with them); the other rows are unaffected."""
    logits, bias, params = routing_case("v3", 3)
    weights, ids = select_experts_triton(logits[:0], bias, *params)
    assert weights.shape == ids.shape == (0, 8)
    logits[1] = float("nan")
    weights, ids = select_experts_triton(logits, bias, *params)
    assert ((ids >= 0) & (ids < 256)).all()
    want_weights, want_ids = by_expert(*select_experts(logits[[0, 2]], bias, *params))
    got_weights, got_ids = by_expert(weights[[0, 2]], ids[[0, 2]])
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)


@in_process
@pytest.mark.parametrize("name", ["v2-lite", "sigmoid-plain"])
def test_select_experts_ties_go_to_the_lowest_index(name):
    """Ids best first and, among equal choice scores, the lowest index first (the order the module
    docstring promises, which the reference leaves open); negative choices (a negative bias) rank as
    the floats do. Rows: all equal; falling with the index (below zero with the bias); random with the
    best score at two experts."""
    k, scoring, method, groups, top_groups, norm, scale, experts, has_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(3)
    logits = torch.stack([torch.zeros(experts), -0.1 * torch.arange(experts, dtype=torch.float32),
                          torch.randn(experts, generator=gen)])
    logits[2, [5, 17]] = logits[2].max() + 1  # the tie at the top: picks 0 and 1 are experts 5 and 17
    bias = torch.full((experts,), -2.0) if has_bias else None
    weights, ids = select_experts_triton(logits.to(DEVICE), None if bias is None else bias.to(DEVICE), k, scoring,
                                         method, groups, top_groups, norm, scale)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores + bias if has_bias else scores
    want = torch.tensor([sorted(range(experts), key=lambda e: (-row[e].item(), e))[:k] for row in choice])
    assert torch.equal(ids.cpu(), want)
    assert ids[2, :2].tolist() == [5, 17]
    torch.testing.assert_close(weights.cpu(), scores.gather(1, want) * scale, rtol=1e-6, atol=0)


@in_process
@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_select_experts_appends_fused_shared_experts(name):
    """num_shared = S: the routed top-k as without it, then experts E..E + S - 1 with weight 1 (not
    normalized or scaled with the routed ones), as the reference op appends them."""
    logits, bias, params = routing_case(name, 5)
    experts = logits.shape[1]
    plain_weights, plain_ids = select_experts_triton(logits, bias, *params)
    weights, ids = select_experts_triton(logits, bias, *params, num_shared=2)
    k = params[0]
    assert ids.shape == weights.shape == (5, k + 2)
    assert torch.equal(ids[:, :k], plain_ids) and torch.equal(weights[:, :k], plain_weights)
    assert (ids[:, k:] == torch.tensor([experts, experts + 1], device=DEVICE)).all() and (weights[:, k:] == 1).all()
    gen = torch.Generator().manual_seed(2)
    x, router = torch.randn(5, 32, generator=gen), torch.randn(experts, 32, generator=gen)
    cpu_bias = None if bias is None else bias.cpu()
    want_weights, want_ids = torch.ops.encore.route(x, router, cpu_bias, *params, 0)
    got_weights, got_ids = torch.ops.encore.route(x, router, cpu_bias, *params, 2)
    assert torch.equal(got_ids[:, :k], want_ids) and torch.equal(got_weights[:, :k], want_weights)
    assert (got_ids[:, k:] == torch.tensor([experts, experts + 1])).all() and (got_weights[:, k:] == 1).all()


@in_process
def test_select_experts_rejects_bad_inputs():
    logits, bias, params = routing_case("v3", 2)
    with pytest.raises(ValueError, match="float32"):
        select_experts_triton(logits.half(), bias, *params)
    with pytest.raises(ValueError, match="top_k=300"):
        select_experts_triton(logits, bias, 300, *params[1:])
    with pytest.raises(ValueError, match="n_group=7"):
        select_experts_triton(logits, bias, params[0], params[1], params[2], 7, 4, *params[5:])
    with pytest.raises(ValueError, match="scoring_func 'tanh'"):
        select_experts_triton(logits, bias, params[0], "tanh", *params[2:])
    with pytest.raises(ValueError, match=r"bias \(255,\)"):
        select_experts_triton(logits, bias[:255], *params)
    with pytest.raises(ValueError, match="num_shared=-1"):
        select_experts_triton(logits, bias, *params, num_shared=-1)


test_cpu_tests_in_child_process = rerun_in_child(__file__)


# ---------------------------------------------------------------- GPU: bf16, real shapes, graphs, dispatch

# Per-token relative error vs float32 with bf16 inputs and a bf16 intermediate (2^-8 rounding of each
# SiLU(gate)·up element); on V2-Lite the fused MoE and experts_grouped differ by ~5e-3 overall.
BF16_TOL = 1e-2
SHAPES = {"v2-lite": dict(experts=64, k=6, hidden=2048, inter=1408),
          "v3": dict(experts=256, k=8, hidden=7168, inter=2048)}


@pytest.fixture(scope="module")
def layer():
    """layer(name) -> random bf16 (w13, w2) of that shape, made once on the GPU (V3's are 22.5 GB, so
    no float32 copy of them is ever made)."""
    made = {}

    def get(name: str):
        if name not in made:
            shape = SHAPES[name]
            gen = torch.Generator(device="cuda").manual_seed(0)
            e, h, i = shape["experts"], shape["hidden"], shape["inter"]
            made[name] = (torch.randn(e, 2 * i, h, generator=gen, device="cuda", dtype=torch.bfloat16) * h ** -0.5,
                          torch.randn(e, h, i, generator=gen, device="cuda", dtype=torch.bfloat16) * i ** -0.5)
        return made[name]

    yield get
    made.clear()
    torch.cuda.empty_cache()


def bf16_routing(tokens: int, name: str, seed: int):
    """x [T, H] bf16, weights [T, k] float32, ids [T, k] int64 (top-k of random scores)."""
    shape = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, shape["hidden"], generator=gen, device="cuda").bfloat16()
    ids = torch.rand(tokens, shape["experts"], generator=gen, device="cuda").topk(shape["k"], dim=-1).indices
    return x, torch.rand(tokens, shape["k"], generator=gen, device="cuda"), ids


def float32_reference(x, w13, w2, weights, ids):
    """experts_torch in float32 over the chosen experts only (renumbered), so that V3 needs no float32
    copy of all its weights."""
    used = ids.unique()  # sorted
    return experts_torch(x.float(), w13[used].float(), w2[used].float(), weights, torch.searchsorted(used, ids))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, tokens", [("v2-lite", 1), ("v2-lite", 8), ("v2-lite", 64), ("v3", 1), ("v3", 4)])
def test_bf16_real_shapes_gpu(layer, name, tokens):
    w13, w2 = layer(name)
    x, weights, ids = bf16_routing(tokens, name, seed=tokens)
    out = fused_moe(x, w13, w2, weights, ids)
    assert max_rel_error(out, float32_reference(x, w13, w2, weights, ids)) < BF16_TOL
    assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))  # deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 64, 200, 300, 1500])
def test_small_shapes_both_dtypes_gpu(tokens, dtype):
    # Every row of the config table; float32 runs the fused MoE on CUDA at every size.
    x, w13, w2, weights, ids = inputs(tokens, 16, 4, 256, 96, dtype=dtype, seed=tokens)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert max_rel_error(fused_moe(x, w13, w2, weights, ids), ref) < (BF16_TOL if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_cuda_graph_replay_gpu(layer, tokens):
    """Capture once, then change the inputs in place, the routing from spread out to every token on
    expert 3: the replay must equal an eager call on the new inputs, bit for bit, replay after replay."""
    w13, w2 = layer("v2-lite")
    static = [t.clone() for t in bf16_routing(tokens, "v2-lite", seed=1)]
    fused_moe(static[0], w13, w2, static[1], static[2])  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2])
    x, weights, ids = bf16_routing(tokens, "v2-lite", seed=2)
    ids = torch.where(ids == 3, ids[:, :1], ids)  # keep each token's experts distinct...
    ids[:, 0] = 3  # ...with expert 3 first
    for buf, new in zip(static, (x, weights, ids)):
        buf.copy_(new)
    graph.replay()
    eager = fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(out, eager)
    assert max_rel_error(out, float32_reference(x, w13, w2, weights, ids)) < BF16_TOL
    for _ in range(20):
        out.zero_()
        graph.replay()
        assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shared", [0, 2])
def test_one_token_layers_chained_in_a_cuda_graph_gpu(layer, shared):
    """A decode step's MoE layers at one token, as the engine runs them: the router's GEMV, the
    selection, gate_up and down, each a programmatic dependent of the one before (sm90+) that may
    launch before it finishes, then the residual add, for four layers whose input is the last one's
    output. Every kernel must read what the kernel before it wrote only once it is written: replay
    after replay, on new inputs, the graph equals eager calls bit for bit. With S shared experts fused
    (the layer's last S, routed over the others), their gate_up programs compute before the selection
    ends: the same bits as every program waiting first (the op told of no shared experts)."""
    w13, w2 = layer("v2-lite")
    k, scoring, method, groups, top_groups, norm, scale, experts, _ = ROUTINGS["v2-lite"]
    gen = torch.Generator(device="cuda").manual_seed(5)
    routers = [torch.randn(experts - shared, 2048, generator=gen, device="cuda").bfloat16() * 2048 ** -0.5
               for _ in range(4)]

    def layers(x, early=shared):
        for router in routers:
            weights, ids = torch.ops.encore.route(x, router, None, k, scoring, method, groups, top_groups, norm,
                                                  scale, shared)
            x = x + torch.ops.encore.routed_experts(x, w13, w2, weights, ids, early)
        return x

    static = torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16)
    layers(static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layers(static)
    for seed in range(3):
        x = bf16_routing(1, "v2-lite", seed=10 + seed)[0]
        static.copy_(x)
        eager = layers(x)
        if shared:
            assert torch.equal(eager, layers(x, early=0)), seed
        for _ in range(10):
            out.zero_()
            graph.replay()
            assert torch.equal(out, eager), seed


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shared", [0, 2])
def test_one_token_layers_with_the_norm_in_the_router_gpu(layer, shared):
    """The chain above as passes/fuse_norms.py leaves a decode graph: each layer's residual add and
    post-attention norm run inside the router's GEMV (``encore::add_rms_norm_route``), whose program 0
    stores the normed row the experts read (the shared experts' programs before the selection ends)
    and the sum the next layer adds to. Replayed on new inputs the graph equals eager calls bit for
    bit; the op's normed row, sum and routing match the CPU reference."""
    w13, w2 = layer("v2-lite")
    k, scoring, method, groups, top_groups, norm, scale, experts, _ = ROUTINGS["v2-lite"]
    params = (k, scoring, method, groups, top_groups, norm, scale, shared)
    gen = torch.Generator(device="cuda").manual_seed(6)
    routers = [torch.randn(experts - shared, 2048, generator=gen, device="cuda").bfloat16() * 2048 ** -0.5
               for _ in range(4)]
    norm_weight = (1 + 0.1 * torch.randn(2048, generator=gen, device="cuda")).bfloat16()

    def layers(x, delta, early=shared):
        for router in routers:
            weights, ids, normed, x = torch.ops.encore.add_rms_norm_route(x, delta, norm_weight, 1e-6, router, None,
                                                                          *params)
            delta = torch.ops.encore.routed_experts(normed, w13, w2, weights, ids, early)
        return x + delta

    for tokens in (1, 64):  # the GEMV with the norm inside; past its token counts, the norm kernel and cuBLAS
        x, delta = (bf16_routing(tokens, "v2-lite", seed=s)[0] for s in (20, 21))
        cpu = [t.cpu() for t in (x, delta, norm_weight, routers[0])]
        want = torch.ops.encore.add_rms_norm_route(*cpu[:3], 1e-6, cpu[3], None, *params)
        got = torch.ops.encore.add_rms_norm_route(x, delta, norm_weight, 1e-6, routers[0], None, *params)
        (got_weights, got_ids), (want_weights, want_ids) = by_expert(got[0].cpu(), got[1].cpu()), by_expert(*want[:2])
        # A row whose normed values round differently may swap two experts that tie to ~1e-3: allow one in 64.
        same = (got_ids == want_ids).all(dim=1)
        assert same.float().mean() >= 1 - 1 / 64 and torch.equal(got[3].cpu(), want[3]), tokens
        torch.testing.assert_close(got_weights[same], want_weights[same], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(got[2].cpu(), want[2], rtol=2 ** -7, atol=1e-2)

    static = torch.zeros(2, 1, 2048, device="cuda", dtype=torch.bfloat16)
    layers(static[0], static[1])  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layers(static[0], static[1])
    for seed in range(3):
        x, delta = (bf16_routing(1, "v2-lite", seed=30 + 2 * seed + i)[0] for i in (0, 1))
        static[0].copy_(x)
        static[1].copy_(delta)
        eager = layers(x, delta)
        if shared:
            assert torch.equal(eager, layers(x, delta, early=0)), seed
        for _ in range(10):
            out.zero_()
            graph.replay()
            assert torch.equal(out, eager), seed


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_op_dispatch_by_pairs_gpu(layer, dtype):
    """The op runs the fused MoE up to FUSED_MOE_MAX_PAIRS pairs and, for bf16, experts_grouped above;
    float32 always the fused MoE (torch._grouped_mm has no float32 GPU kernel)."""
    w13, w2 = (w.to(dtype) for w in layer("v2-lite"))
    k = SHAPES["v2-lite"]["k"]
    for tokens in (FUSED_MOE_MAX_PAIRS // k, FUSED_MOE_MAX_PAIRS // k + 1):
        x, weights, ids = bf16_routing(tokens, "v2-lite", seed=tokens)
        x = x.to(dtype)
        grouped = dtype == torch.bfloat16 and ids.numel() > FUSED_MOE_MAX_PAIRS
        want = (experts_grouped if grouped else fused_moe)(x, w13, w2, weights, ids)
        assert torch.equal(torch.ops.encore.routed_experts(x, w13, w2, weights, ids, 0), want), (tokens, grouped)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name,hidden,shared", [("v2-lite", 2048, 2), ("v3", 7168, 1), ("encore-tiny", 192, 0)])
def test_route_op_matches_reference_gpu(name, hidden, shared, dtype):
    """``encore::route`` on CUDA (a 16-bit GEMM with float32 output, or a float32 GEMM, then the
    selection kernel) against the CPU reference (float32 logits of the same values) at decode and
    prefill sizes, and inside a CUDA graph; with the model's shared experts fused, and without."""
    k, scoring, method, groups, top_groups, norm, scale, experts, has_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(1)
    params = (k, scoring, method, groups, top_groups, norm, scale, shared)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(dtype) if has_bias else None
    on = lambda t: None if t is None else t.cuda()  # noqa: E731
    for tokens in (1, 64, 700):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        want_weights, want_ids = by_expert(*torch.ops.encore.route(x, weight, bias, *params))  # CPU reference
        got_weights, got_ids = by_expert(*torch.ops.encore.route(on(x), on(weight), on(bias), *params))
        # A GEMM's summation order may swap two experts whose scores tie to ~1e-6: allow one row in 200.
        same = (got_ids.cpu() == want_ids).all(dim=1)
        assert same.float().mean() >= 1 - 1 / 200, (tokens, (~same).sum().item())
        torch.testing.assert_close(got_weights.cpu()[same], want_weights[same], rtol=1e-4, atol=1e-5)
    static, weight, bias = on(x[:64].clone()), on(weight), on(bias)
    torch.ops.encore.route(static, weight, bias, *params)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.encore.route(static, weight, bias, *params)
    static.copy_(on(x[64:128]))
    graph.replay()
    want = torch.ops.encore.route(on(x[64:128]), weight, bias, *params)
    assert torch.equal(out[1], want[1]) and torch.equal(out[0], want[0])
