"""encore's DeepSeek V2/V3 against transformers' own implementation on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from encore.engine import Engine, SamplingParams
from encore.engine.request import Request
from encore.engine.scheduler import ScheduledStep
from encore.engine.step import build_forward_batch

KINDS = ["v2_lite", "v2", "v3"]


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def run_rows(engine: Engine, rows: list[tuple[Request, int, bool]], q_len: int = 1) -> list[torch.Tensor]:
    """One step with the given (request, tokens, is_decode) rows; returns each row's logits [n, V]."""
    step = ScheduledStep(extends=[(r, n) for r, n, dec in rows if not dec],
                         decodes=[r for r, n, dec in rows if dec], q_len_per_req=q_len)
    for req, n, is_decode in rows:
        assert engine.kv.reserve(req.request_id, req.num_computed + n)
        if is_decode:  # the verify shape: the next token plus "drafts" that are the true continuation
            req.draft_token_ids = req.token_ids[req.num_computed + 1:req.num_computed + n]
    batch, _ = build_forward_batch(step, engine.kv, engine.runner.device)
    batch.gather_ids = torch.arange(batch.num_tokens)
    with torch.inference_mode():
        logits = engine.runner.model.compute_logits(engine.runner.forward(batch))
    out, start = [], 0
    for req, n in step.extends + [(r, q_len) for r in step.decodes]:
        out.append(logits[start:start + n])
        start += n
        req.num_computed += n
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_through_prefill_chunks_and_decode(kind, checkpoint):
    path = checkpoint(kind)
    torch.manual_seed(1)
    ids = torch.randint(2, 320, (2, 23))
    with torch.no_grad():
        ref = hf_model(path)(ids).logits  # [2, 23, V]
    engine = Engine(str(path), device="cpu", dtype="float32", page_size=4, num_kv_pages=64)
    a = Request("a", ids[0].tolist(), SamplingParams(), 0, None)
    b = Request("b", ids[1].tolist(), SamplingParams(), 0, None)
    # a: prefill 9, prefill 5 with cached prefix, then decode rows of q_len 1 and 3 (the verify shape);
    # b rides along so that EXTEND, MIXED and DECODE layouts all occur.
    plan = [
        ([(a, 9, False)], 1),
        ([(a, 5, False), (b, 12, False)], 1),
        ([(b, 4, False), (a, 1, True)], 1),
        ([(a, 3, True), (b, 3, True)], 3),
        ([(b, 4, False), (a, 1, True)], 1),
        ([(a, 4, False)], 1),
    ]
    for rows, q_len in plan:
        starts = [r.num_computed for r, _, _ in rows]
        for (req, n, _), start, got in zip(rows, starts, run_rows(engine, rows, q_len)):
            want = ref[0 if req is a else 1, start:start + n]
            assert rel_err(got, want) <= 1e-4, (kind, req.request_id, start, n)
    assert a.num_computed == b.num_computed == 23


@pytest.mark.parametrize("kind", KINDS)
def test_24_greedy_tokens_match_transformers(kind, checkpoint):
    path = checkpoint(kind)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(40, 73))]
    engine = Engine(str(path), device="cpu", dtype="float32", page_size=4, chunked_prefill_size=8,
                    max_num_batched_tokens=16)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    model = hf_model(path)
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length" and out.finished
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
