"""Structured output fuzz: >= 100 generated JSON schemas, regexes and EBNF grammars on a random-weight
model (it knows nothing of JSON). Every finished output validates, and a fresh matcher replaying each
output allows every emitted token — in DECODE-only, MIXED and speculative workloads."""

from __future__ import annotations

import json
import random
import re

import pytest
import xgrammar as xgr

from checkpoints import write_mtp_checkpoint
from encore.engine import Engine, SamplingParams
from workloads import run_staggered

N_EACH = 36  # schemas, regexes and grammars: 108 in all


def random_schema(rng: random.Random) -> dict:
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["integer", "boolean", "enum", "string"])
        if kind == "integer":
            props[f"n{i}"] = {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 99)}
        elif kind == "boolean":
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == "enum":
            props[f"e{i}"] = {"enum": rng.sample(["red", "green", "blue", "fox", "dog"], rng.randint(1, 3))}
        else:
            props[f"s{i}"] = {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 4)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def random_regex(rng: random.Random) -> str:
    parts = [rng.choice(["[a-c]{1,3}", r"\d{1,2}", "(yes|no)", "(fox|dog|cat)", "[xyz]", "(ab){1,2}"])
             for _ in range(rng.randint(1, 3))]
    return rng.choice(["-", ":", " "]).join(parts)


def random_ebnf(rng: random.Random) -> str:
    words = rng.sample(["yes", "no", "fox", "dog", "42", "a", "bc"], 4)
    atom = " | ".join(f'"{w}"' for w in words[:rng.randint(2, 4)])
    return rng.choice([
        f'root ::= atom\natom ::= {atom}',
        f'root ::= "(" atom ")" | atom "!"\natom ::= {atom}',
        f'root ::= atom ("," atom)?\natom ::= {atom}',
    ])


def obeys(value, schema: dict) -> bool:
    """Whether ``value`` satisfies a ``random_schema`` schema (its four property kinds, all required, no
    others). The GPU machine has no jsonschema (its rpds-py has no wheel there), so the checks use this;
    ``test_obeys_agrees_with_jsonschema`` holds it to jsonschema's verdicts on the CPU."""
    props = schema["properties"]
    if not isinstance(value, dict) or set(value) != set(props):
        return False
    for name, rule in props.items():
        v = value[name]
        if "enum" in rule:
            ok = v in rule["enum"]
        elif rule["type"] == "integer":
            # JSON Schema's integers include numbers with a zero fraction (1.0), never booleans
            ok = (type(v) is int or type(v) is float and v.is_integer()) and rule["minimum"] <= v <= rule["maximum"]
        elif rule["type"] == "boolean":
            ok = type(v) is bool
        else:
            ok = type(v) is str and rule["minLength"] <= len(v) <= rule["maxLength"]
        if not ok:
            return False
    return True


def constraints(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    specs = [{"json_schema": random_schema(rng)} for _ in range(N_EACH)]
    specs += [{"regex": random_regex(rng)} for _ in range(N_EACH)]
    specs += [{"ebnf": random_ebnf(rng)} for _ in range(N_EACH)]
    return specs


def check(engine: Engine, spec: dict, out) -> bool:
    """Replays out.token_ids through a fresh matcher; validates finished text. True if it finished."""
    pool = engine._grammar_pool()
    compiled = pool.submit(SamplingParams(**spec).grammar).result()
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, engine.model_config.vocab_size)
    for t in out.token_ids:
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(mask, 0)
        assert (mask[0, t // 32] >> (t % 32)) & 1, (spec, out.token_ids, t)
        assert matcher.accept_token(t)
    if out.finish_reason != "stop":
        return False
    assert matcher.is_terminated() or matcher.is_completed(), (spec, out.text)
    if "json_schema" in spec:
        assert obeys(json.loads(out.text), spec["json_schema"]), (spec, out.text)
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], out.text), (spec, out.text)
    return True


def run(engine: Engine, specs: list[dict], arrivals=None, temperature: float = 1.0) -> list:
    params = [SamplingParams(max_tokens=48, temperature=temperature, seed=i, **s) for i, s in enumerate(specs)]
    if arrivals is None:
        return engine.generate([[5 + i % 40, 6, 7] for i in range(len(specs))], params)
    prompts = [[5 + i % 40] * (3 + i % 9) for i in range(len(specs))]
    done = run_staggered(engine, prompts, params, arrivals, prefix="c")
    return [done[f"c{i}"] for i in range(len(specs))]


def valid_and_broken(rule: dict, rng: random.Random) -> tuple[list, list]:
    """Values a ``random_schema`` property rule takes (its bounds among them) and values it refuses."""
    if "enum" in rule:
        return rule["enum"], [w for w in ("red", "green", "blue", "fox", "dog") if w not in rule["enum"]] + [0, None]
    if rule["type"] == "integer":
        top = rule["maximum"]
        return [0, top, float(top), rng.randint(0, top)], [-1, top + 1, 0.5, True, "1", None]
    if rule["type"] == "boolean":
        return [True, False], [0, 1, "true", None]
    top = rule["maxLength"]
    return ["a", "b" * top], ["", "c" * (top + 1), 1, None]


def test_obeys_agrees_with_jsonschema():
    import jsonschema

    rng = random.Random(3)
    verdicts = []
    for _ in range(200):
        schema = random_schema(rng)
        validator = jsonschema.Draft202012Validator(schema)
        good = {name: valid_and_broken(rule, rng)[0] for name, rule in schema["properties"].items()}
        value = {name: rng.choice(values) for name, values in good.items()}
        candidates = [value, {**value, "extra": 1}, dict(list(value.items())[1:]), list(value), 5]
        for name, rule in schema["properties"].items():
            candidates += [{**value, name: v} for v in good[name] + valid_and_broken(rule, rng)[1]]
        for candidate in candidates:
            verdicts.append(obeys(candidate, schema))
            assert verdicts[-1] == validator.is_valid(candidate), (schema, candidate)
    assert 0.2 < sum(verdicts) / len(verdicts) < 0.8  # both verdicts, each often


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return write_mtp_checkpoint(tmp_path_factory.mktemp("mtp_grammar"))


def workload_engine(name: str, v3_dir, mtp_dir) -> tuple[Engine, list | None]:
    if name == "decode":
        return Engine(str(v3_dir), device="cpu", page_size=4, max_num_seqs=128), None
    if name == "mixed":
        return (Engine(str(v3_dir), device="cpu", page_size=4, chunked_prefill_size=8, max_num_batched_tokens=48),
                [i // 4 for i in range(3 * N_EACH)])
    method, k = {"ngram-1": ("ngram", 1), "ngram-2": ("ngram", 2), "mtp-3": ("mtp", 3), "mtp-4": ("mtp", 4)}[name]
    path = mtp_dir if method == "mtp" else v3_dir
    return Engine(str(path), device="cpu", page_size=4, max_num_seqs=128,
                  speculative={"method": method, "num_speculative_tokens": k}), None


@pytest.mark.parametrize("workload", ["decode", "mixed", "ngram-1", "ngram-2", "mtp-3", "mtp-4"])
def test_every_output_obeys_its_grammar(workload, v3_dir, mtp_dir):
    engine, arrivals = workload_engine(workload, v3_dir, mtp_dir)
    specs = constraints()
    outs = run(engine, specs, arrivals)
    finished = sum(check(engine, s, o) for s, o in zip(specs, outs))
    assert finished >= 0.8 * len(specs), f"only {finished}/{len(specs)} grammars terminated"
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    if workload == "mixed":
        assert stats["steps"]["MIXED"] > 0
    if workload.startswith(("ngram", "mtp")):
        assert stats["spec_draft_tokens"] > 0


NEIGHBOURS = [[9, 10, 11], [40, 41]]  # unconstrained prompts sharing steps with constrained rows


@pytest.fixture(scope="module")
def neighbours_alone(v3_dir) -> list[list[int]]:
    """NEIGHBOURS' 16 greedy tokens each, with no other row in the engine."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in Engine(str(v3_dir), device="cpu").generate(NEIGHBOURS, greedy)]


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(v3_dir, neighbours_alone):
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = Engine(str(v3_dir), device="cpu")
    mixed = engine.generate(NEIGHBOURS + [[5, 6]] * 4, [greedy, greedy] + [SamplingParams(max_tokens=16, **s)
                                                                            for s in constraints(1)[::30]])
    assert [o.token_ids for o in mixed[:2]] == neighbours_alone


def test_invalid_grammars_are_rejected_at_add_request(v3_dir):
    engine = Engine(str(v3_dir), device="cpu")
    with pytest.raises(ValueError, match="invalid regex"):
        engine.add_request("r", [5], SamplingParams(regex="a("))
    with pytest.raises(ValueError, match="invalid ebnf"):
        engine.add_request("e", [5], SamplingParams(ebnf="root ::= "))
    assert not engine.requests and not engine.has_unfinished_requests()


@pytest.mark.parametrize("options", [dict(), dict(overlap_schedule=True),
                                     dict(speculative={"method": "ngram", "num_speculative_tokens": 2})])
def test_a_grammar_that_allows_no_token_aborts_its_request_alone(v3_dir, neighbours_alone, options):
    """An empty language, or a prefix nothing continues, masks every logit of its row: that request
    ends (abort, without the meaningless token) and the step's other rows are unchanged."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = Engine(str(v3_dir), device="cpu", **options)
    dead = [SamplingParams(max_tokens=8, ebnf="root ::= root"),
            SamplingParams(max_tokens=8, temperature=0.0, regex="a[^\\x00-\\U0010FFFF]"),  # after "a"
            SamplingParams(max_tokens=8, top_p=0.5, seed=1, regex="[^\\x00-\\U0010FFFF]")]
    outs = engine.generate(NEIGHBOURS + [[5, 6]] * len(dead), [greedy, greedy] + dead)
    assert [o.token_ids for o in outs[:2]] == [t[:8] for t in neighbours_alone]
    assert [o.finish_reason for o in outs[2:]] == ["abort"] * len(dead)
    assert [o.text for o in outs[2:]] == ["", "a", ""]
    stats = engine.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and not engine.requests


def test_json_object_produces_json(v3_dir):
    engine = Engine(str(v3_dir), device="cpu")
    outs = engine.generate([[5, 6]] * 8, [SamplingParams(max_tokens=64, seed=i, json_object=True) for i in range(8)])
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(o.text), (dict, list)) for o in done)


def test_a_request_waits_for_its_grammar_while_others_run(v3_dir):
    from concurrent.futures import Future

    from encore.engine.grammar import RequestGrammar

    engine = Engine(str(v3_dir), device="cpu")
    engine.add_request("slow", [5, 6], SamplingParams(max_tokens=4, regex="(yes|no)"))
    pending: Future = Future()
    compiled = engine.requests["slow"].grammar.future
    engine.requests["slow"].grammar = RequestGrammar(pending)  # a grammar still compiling
    engine.add_request("free", [7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finished = set()
    for _ in range(6):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"free"} and engine.requests["slow"].num_computed == 0
    pending.set_result(compiled.result())
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "slow" in finished


GPU_KEYS = dict(graph_decode_sizes=(8, 32, 64, 128), graph_mixed_decode_sizes=(16, 64), graph_prefill_tokens=(64, 256),
                graph_extend_sizes=(1,), graph_mixed_extends=(1,), max_num_seqs=128, max_model_len=256)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 2}])
def test_every_output_obeys_its_grammar_with_cuda_graphs(v3_dir, speculative):
    engine = Engine(str(v3_dir), device="cuda", dtype="float32", compile=False, cuda_graphs=True,
                    speculative=speculative, **GPU_KEYS)
    specs = constraints(2)
    outs = run(engine, specs)
    finished = sum(check(engine, s, o) for s, o in zip(specs, outs))
    assert finished >= 0.8 * len(specs), f"only {finished}/{len(specs)} grammars terminated"
    assert engine.stats()["graph_replays"] > 0
