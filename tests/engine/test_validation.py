"""Bad input gets a ValueError naming the field and the allowed range; nothing else is lost."""

from __future__ import annotations

import numpy as np
import pytest

from encore.engine import Engine, SamplingParams


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.1, r"temperature must be 0 \(greedy\) or in \[1e-06, 1e\+06\]"),
    # Past these bounds the sampler's float32 division overflows or the value rounds to 0 or inf.
    ("temperature", 1e-40, r"temperature must be 0 \(greedy\) or in \[1e-06, 1e\+06\], got 1e-40"),
    ("temperature", float("inf"), r"temperature must be 0 \(greedy\) or in .*got inf"),
    ("temperature", 1e300, r"temperature must be 0 \(greedy\) or in .*got 1e\+300"),
    ("temperature", None, r"temperature must be 0 \(greedy\) or in .*got None"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("top_k", -1, r"top_k must be an integer in \[0, 2\*\*31\)"),
    ("top_k", 2**31, r"top_k must be an integer in \[0, 2\*\*31\)"),
    ("min_p", 2.0, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be in \[1e-06, 1e\+06\] \(1 is off\), got 0.0"),
    ("repetition_penalty", 1e-300, r"repetition_penalty must be in \[1e-06, 1e\+06\]"),
    ("repetition_penalty", float("inf"), r"repetition_penalty must be in \[1e-06, 1e\+06\]"),
    ("top_p", "0.5", r"top_p must be in \(0, 1\], got '0.5'"),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\]"),
    ("seed", -1, "seed must be an integer"),
    ("logprobs", 21, r"logprobs must be an integer in \[0, 20\]"),
    ("stop", [""], "stop must be non-empty strings"),
    # bools are ints in Python: True would pass as 1
    ("max_tokens", True, "max_tokens must be an integer >= 1, got True"),
    ("top_k", True, r"top_k must be an integer .*got True"),
    ("seed", False, "seed must be an integer .*got False"),
    ("logprobs", True, r"logprobs must be an integer .*got True"),
    ("min_tokens", True, r"min_tokens must be an integer .*got True"),
    ("stop_token_ids", [True], r"stop_token_ids must be non-negative integers, got \(True,\)"),
    ("ignore_eos", 1, "ignore_eos must be True or False, got 1"),
    ("json_object", "yes", "json_object must be True or False, got 'yes'"),
])
def test_sampling_params_reject_out_of_range_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def engine(v3_dir):
    return Engine(str(v3_dir), device="cpu", page_size=4, max_model_len=64)


def test_bad_requests_are_rejected_and_others_keep_running(engine):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("good", [5, 6, 7], params)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 320\)"):
        engine.add_request("bad-ids", [5, 320], params)
    with pytest.raises(ValueError, match=r"prompt has 64 tokens; the context is 64"):
        engine.add_request("too-long", [5] * 64, params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], params)
    with pytest.raises(ValueError, match=r"stop_token_ids \[999\] are outside"):
        engine.add_request("bad-stop", [5], SamplingParams(stop_token_ids=[999]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [5], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [o.request_id for o in outs if o.finished] == ["good"]
    assert outs[-1].token_ids == engine.generate([[5, 6, 7]], params)[0].token_ids
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_prompt_ids_must_be_integers_and_numpys_are(engine):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompt token ids must be integers, got \['5', 6.0\]"):
        engine.add_request("str", ["5", 6.0, 7], params)
    with pytest.raises(ValueError, match=r"prompt token ids must be integers, got \[True\]"):
        engine.add_request("bool", [5, True], params)
    want = engine.generate([[5, 6, 7]], params)[0].token_ids
    assert engine.generate([np.array([5, 6, 7])], params)[0].token_ids == want
    assert not engine.requests


def test_generate_with_one_bad_prompt_leaves_nothing_behind(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 6], [400]], SamplingParams(max_tokens=2))
    assert not engine.requests and not engine.has_unfinished_requests()


def test_abort_frees_pages_and_reports_abort(engine):
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(2, 30)), params)
    engine.add_request("b", [4, 5], params)
    engine.step()
    engine.step()
    engine.abort("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    engine.abort("b")
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]


def test_generation_stops_at_the_context_length(engine):
    out = engine.generate([list(range(2, 60))], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 58


def test_unknown_engine_options_and_bad_values_are_named(v3_dir):
    with pytest.raises(ValueError, match="page_size must be an integer >= 1"):
        Engine(str(v3_dir), device="cpu", page_size=0)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        Engine(str(v3_dir), device="cpu", attention_backend="nope")
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'no'"):
        Engine(str(v3_dir), device="cpu", enable_prefix_caching="no")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine(str(v3_dir / "missing"), device="cpu")
    with pytest.raises(ValueError, match="overlap_schedule must be True, False or None .*got 'yes'"):
        Engine(str(v3_dir), device="cpu", overlap_schedule="yes")
    with pytest.raises(ValueError, match="overlap_schedule=True: speculative decoding does not overlap"):
        Engine(str(v3_dir), device="cpu", overlap_schedule=True,
               speculative={"method": "ngram", "num_speculative_tokens": 2})


def test_overlap_switches_only_between_steps_and_never_with_speculation(v3_dir):
    engine = Engine(str(v3_dir), device="cpu", overlap_schedule=True)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # its token is in flight now
    with pytest.raises(RuntimeError, match="only change while no step is in flight"):
        engine.overlap_schedule = False
    while engine.has_unfinished_requests():
        engine.step()
    engine.overlap_schedule = False
    assert not engine.overlap_schedule
    spec = Engine(str(v3_dir), device="cpu", speculative={"method": "ngram", "num_speculative_tokens": 2})
    assert not spec.overlap_schedule
    with pytest.raises(ValueError, match="speculative decoding does not overlap"):
        spec.overlap_schedule = True
