"""Host time to build one step's grammar masks at bs = 64 (CPU), next to the unconstrained floor.

Rows are JSON-schema-constrained decode rows (plain, and spec-verify rows with k drafts walked and
rolled back); the floor is allocating the same all-allowed bitmask. Uses encore-tiny's tokenizer.

    python benchmarks/bench_grammar_masks.py [--bs 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from transformers import AutoTokenizer

from bench_scheduler import timed
from encore.engine.grammar import GrammarCompilerPool, RequestGrammar, allocate_bitmask, grammar_spec, step_bitmask
from encore.models.tiny import default_model_dir

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age", "tags"]}
# xgrammar checks length-bounded strings token by token at run time: the slow case, shown apart.
BOUNDED = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 12}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    vocab = len(tok)
    pool = GrammarCompilerPool(tok, vocab, [tok.eos_token_id])
    prefix = tok.encode('{"name": "ab', add_special_tokens=False)
    rows = []
    for label, schema, k in (("json", SCHEMA, 0), ("json", SCHEMA, 4), ("json maxLength", BOUNDED, 0),
                             ("json maxLength", BOUNDED, 4)):
        spec = grammar_spec(schema, None, None, False)
        grammars = []
        for _ in range(args.bs):
            g = RequestGrammar(pool.submit(spec))
            g.future.result()
            g.ready()
            g.accept(prefix)
            grammars.append(g)
        drafts = tok.encode("cdefghij", add_special_tokens=False)[:k]
        groups = [(g, drafts) for g in grammars]
        us = timed(lambda: step_bitmask(groups, vocab), args.iters)
        floor = timed(lambda: allocate_bitmask(args.bs * (k + 1), vocab), args.iters)
        rows.append({"grammar": label, "rows": f"{args.bs} x (1 + {k})", "host_us": round(us, 1),
                     "floor_us": round(floor, 1)})
    pool.shutdown()
    print(f"{'grammar':16} {'constrained rows':18} {'host µs':>10} {'floor µs':>9}")
    for r in rows:
        print(f"{r['grammar']:16} {r['rows']:18} {r['host_us']:>10} {r['floor_us']:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
