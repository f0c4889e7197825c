"""``SamplingParams.min_tokens``: a request's first min_tokens tokens are neither EOS nor its stop
token ids (masked), and a stop string they complete does not end it. Greedy tokens against
transformers' ``generate(min_new_tokens=...)`` on tiny random checkpoints, plain and speculative."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import write_mtp_checkpoint
from encore.engine import Engine, SamplingParams
from encore.engine.grammar import step_bitmask

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(40, 73))]
MIN_TOKENS = 6


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return write_mtp_checkpoint(tmp_path_factory.mktemp("mtp_min_tokens"))


def engine_for(setting: str, v3_dir, mtp_dir) -> Engine:
    options = dict(device="cpu", dtype="float32", page_size=4)
    if setting == "plain":
        return Engine(str(v3_dir), **options)
    method, k = {"ngram-2": ("ngram", 2), "mtp-3": ("mtp", 3)}[setting]
    return Engine(str(mtp_dir if method == "mtp" else v3_dir), speculative={"method": method,
                                                                          "num_speculative_tokens": k}, **options)


@pytest.mark.parametrize("setting", ["plain", "ngram-2", "mtp-3"])
def test_stop_tokens_wait_for_min_tokens_as_in_transformers(setting, v3_dir, mtp_dir):
    """Each prompt's stop tokens are the first 8 distinct tokens of its unconstrained greedy run, so
    without min_tokens it ends at once; with min_tokens 1-8, the run matches transformers'
    min_new_tokens and ends at the first stop token from there on (with speculation, the ban reaches
    every position of a verify row: 1 + k of them)."""
    engine = engine_for(setting, v3_dir, mtp_dir)
    free = engine.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(mtp_dir if setting == "mtp-3" else v3_dir, dtype=torch.float32).eval()
    for prompt, first in zip(PROMPTS, free):
        stops = tuple(dict.fromkeys(first.token_ids))[:8]
        for min_tokens in range(1, 9):
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=stops,
                                    min_tokens=min_tokens)
            out = engine.generate([prompt], params)[0]
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=min_tokens,
                                 do_sample=False, eos_token_id=list(stops), pad_token_id=0)[0, len(prompt):].tolist()
            assert out.token_ids == ref, (setting, prompt, min_tokens)
            assert len(out.token_ids) > min_tokens and not set(stops) & set(out.token_ids[:min_tokens])
            assert out.finish_reason == ("stop" if out.token_ids[-1] in stops else "length")
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    if setting != "plain":  # drafts verified; n-gram's accepted too (the random MTP layer's rarely are)
        assert stats["spec_draft_tokens"] > 0 and (setting != "ngram-2" or stats["spec_accepted_tokens"] > 0)


def test_eos_waits_for_min_tokens(v3_dir):
    """EOS is banned like a stop token id: the model's EOS as the stop, min_tokens past where it came."""
    engine = Engine(str(v3_dir), device="cpu", dtype="float32", page_size=4)
    free = engine.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eos = sorted(engine.eos_token_ids)
    for prompt, first in zip(PROMPTS, free):
        assert first.token_ids[0] != first.token_ids[1], "the test needs a second token unlike the first"
        engine.eos_token_ids = frozenset({first.token_ids[1]})  # the model "ends" at its second token
        assert engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids == \
            first.token_ids
        out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, min_tokens=MIN_TOKENS))[0]
        assert len(out.token_ids) > MIN_TOKENS and first.token_ids[1] not in out.token_ids[:MIN_TOKENS]
    assert eos  # the checkpoint has one; the test replaced it


def test_stop_strings_wait_for_min_tokens():
    """encore-tiny (it has a tokenizer): a stop string its greedy text completes early ends the run only
    at the first token from min_tokens on that completes one."""
    engine = Engine(device="cpu", seed=3)
    prompt, stop = "def fibonacci(n):\n", "f"
    free = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].token_ids
    texts = [engine.tokenizer.decode(free[:i]) for i in range(len(free) + 1)]
    assert stop in texts[MIN_TOKENS]  # without min_tokens the run would end before MIN_TOKENS tokens
    # The first token past the first MIN_TOKENS whose text completes the stop string (vLLM's boundary).
    end = next(i for i in range(MIN_TOKENS + 1, len(free) + 1) if stop in texts[i][len(texts[i - 1]):])
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop,
                                                   min_tokens=MIN_TOKENS))[0]
    assert out.token_ids == free[:end] and out.finish_reason == "stop"
    assert out.text == texts[end][:texts[end].rindex(stop)]


def test_bans_clear_their_bits_over_the_positions_short_of_min_tokens():
    """A ban clears its tokens' bits (31 and 63 are the sign bits of their int32 words) in the first rows
    of its group, verify rows included, and nowhere else."""
    groups = [(None, [], ((31, 32), 2)), (None, [7, 8], ((0, 63), 2)), (None, [4], ((5,), 9)), (None, [], None)]
    bitmask = step_bitmask(groups, 70)
    allowed = [[bool(bitmask[row, t // 32] >> (t % 32) & 1) for t in range(70)] for row in range(bitmask.shape[0])]
    banned = {0: {31, 32}, 1: {0, 63}, 2: {0, 63}, 4: {5}, 5: {5}}
    assert [{t for t in range(70) if not a[t]} for a in allowed] == [banned.get(row, set()) for row in range(7)]
    assert step_bitmask([(None, [], None), (None, [1], None)], 70) is None


def test_min_tokens_is_checked():
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens must be"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens=2 cannot be combined with structured output"):
        SamplingParams(min_tokens=2, regex="[a-z]+")


def test_min_tokens_that_would_ban_every_token_is_refused(v3_dir):
    """Its rows would be all -inf: token 0 drawn from NaN probabilities, a stop token that ends it at once."""
    engine = Engine(str(v3_dir), device="cpu")
    vocab = engine.model_config.vocab_size
    others = [t for t in range(vocab) if t not in engine.eos_token_ids]
    with pytest.raises(ValueError, match=rf"min_tokens=3 would ban every token: stop_token_ids and EOS cover "
                                         rf"the whole vocabulary \[0, {vocab}\)"):
        engine.add_request("all", [5], SamplingParams(max_tokens=4, min_tokens=3, stop_token_ids=others))
    with pytest.raises(ValueError, match="min_tokens=3 would ban every token: stop_token_ids cover"):
        engine.add_request("all", [5], SamplingParams(max_tokens=4, min_tokens=3, ignore_eos=True,
                                                      stop_token_ids=range(vocab)))
    params = SamplingParams(max_tokens=4, min_tokens=3, temperature=0.0, stop_token_ids=others[1:])
    out = engine.generate([[5]], params)[0]  # one token left: it is sampled, and past min_tokens
    assert len(out.token_ids) >= 3 and not engine.requests


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 2}])
def test_cuda_graph_steps_hold_off_stop_tokens_as_the_cpu_does(v3_dir, speculative):
    """On CUDA graphs (greedy head graphs, overlapped steps without speculation) a row short of its
    min_tokens leaves the plain-greedy path for the masked one: float32 tokens equal the CPU engine's."""
    options = dict(dtype="float32", page_size=4, speculative=speculative)
    cpu = Engine(str(v3_dir), device="cpu", **options)
    gpu = Engine(str(v3_dir), device="cuda", compile=False, cuda_graphs=True, max_model_len=256, **options)
    free = cpu.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(f.token_ids[1],),
                             min_tokens=MIN_TOKENS) for f in free]
    want = [o.token_ids for o in cpu.generate(PROMPTS, params)]
    assert all(len(w) > MIN_TOKENS for w in want)
    assert [o.token_ids for o in gpu.generate(PROMPTS, params)] == want
    assert gpu.stats()["graph_replays"] > 0
