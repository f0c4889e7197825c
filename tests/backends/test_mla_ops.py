"""The attention-path custom ops: step-context binding and the checks that name what is wrong."""

from __future__ import annotations

import pytest
import torch

from encore.backends import mla_ops  # noqa: F401  (registers torch.ops.encore.*)
from encore.backends.context import StepContext, current_step
from encore.backends.metadata import ForwardBatch
from encore.backends.rope import apply_rotary


def tiny_batch(tokens: int) -> ForwardBatch:
    ids = torch.arange(tokens)
    return ForwardBatch(num_extends=0, q_len_per_req=1, bs=tokens, num_tokens=tokens, page_size=4, input_ids=ids,
                        positions=ids, slot_mapping=ids + 4, seq_lens=(ids + 1).int(), prefix_lens=ids.int(),
                        qo_indptr=torch.arange(tokens + 1).int(), page_table=torch.ones(tokens, 1).int(),
                        gather_ids=ids, seq_lens_cpu=list(range(1, tokens + 1)), prefix_lens_cpu=list(range(tokens)))


def test_ops_outside_a_step_say_how_to_bind_one():
    with pytest.raises(RuntimeError, match="outside a step"):
        torch.ops.encore.write_latent_cache(torch.zeros(2, 4), torch.zeros(2, 2), torch.zeros(3, 4, 6))


def test_context_binds_once_and_resets():
    ctx = StepContext(backend=None)
    batch = tiny_batch(2)
    with ctx.bind(batch):
        assert current_step() is ctx and ctx.batch is batch
        with pytest.raises(RuntimeError, match="not reentrant"):
            with ctx.bind(batch):
                pass
    assert ctx.batch is None
    with pytest.raises(RuntimeError):
        current_step()


def test_token_count_mismatch_is_named():
    with StepContext(backend=None).bind(tiny_batch(3)):
        with pytest.raises(ValueError, match="kv_c has 2 tokens but the bound step has 3"):
            torch.ops.encore.write_latent_cache(torch.zeros(2, 4), torch.zeros(2, 2), torch.zeros(3, 4, 6))


def test_rope_cache_write_on_cpu_is_rotary_then_write():
    torch.manual_seed(0)
    batch = tiny_batch(3)
    q_pe, kv_c, k_pe, cos_sin = torch.randn(3, 2, 4), torch.randn(3, 6), torch.randn(3, 4), torch.randn(8, 4)
    cache = torch.zeros(3, 4, 10)
    with StepContext(backend=None).bind(batch):
        q_rot = torch.ops.encore.rope_cache_write(batch.positions, q_pe, kv_c, k_pe, cos_sin, cache, True)
    want_q, want_k = apply_rotary(batch.positions, q_pe, k_pe, cos_sin, True)
    assert torch.equal(q_rot, want_q)
    assert torch.equal(cache.view(-1, 10)[batch.slot_mapping], torch.cat([kv_c, want_k], dim=-1))
    assert cache.view(-1, 10)[:4].abs().sum() == 0  # nothing outside the step's slots


def test_rope_absorb_on_cpu_is_rope_cache_write_and_the_latent_query():
    torch.manual_seed(0)
    batch = tiny_batch(3)
    q_nope, q_pe, kv_c, k_pe = torch.randn(3, 2, 5), torch.randn(3, 2, 4), torch.randn(3, 6), torch.randn(3, 4)
    cos_sin, w_kc, norm = torch.randn(8, 4), torch.randn(2, 5, 6), torch.rand(6) + 0.5
    cache, want_cache = torch.zeros(3, 4, 10), torch.zeros(3, 4, 10)
    with StepContext(backend=None).bind(batch):
        q_rot, q_lat = torch.ops.encore.rope_absorb(batch.positions, q_nope, q_pe, kv_c, k_pe, cos_sin, w_kc, cache,
                                                    False, norm, 1e-6)
        want_rot = torch.ops.encore.rope_cache_write(batch.positions, q_pe, kv_c, k_pe, cos_sin, want_cache, False,
                                                     norm, 1e-6)
    assert torch.equal(q_rot, want_rot) and torch.equal(cache, want_cache)
    assert q_lat.is_contiguous() and torch.allclose(q_lat, torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1))
