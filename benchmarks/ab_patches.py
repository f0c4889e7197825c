"""A/B of source changes in one device call: a benchmark on the tree as it is, then again after each
patch in turn (applied on top of the ones before, ``patch -p1`` from the repository root), then the
patches reversed. The project is installed editable, so a patched file is what the next run imports.

Each run writes OUT/<tree>.json (the benchmark's ``--json``; tree "base", then each patch's file name
without ".patch") and OUT/<tree>.log (its output's last lines). For a benchmark whose JSON has
``bench_overlap.py``'s rows, it then prints, a row a batch size, each tree's overlapped decode step
(median and trial range), the floor, whether the tokens were the same with and without overlap, and the
kernels compiled while serving.

    python benchmarks/ab_patches.py --out OUT --bench "bench_overlap.py --model v2-lite --batch-sizes 1,64
        --trials 3" a.patch b.patch
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(bench: str, out: Path, tree: str) -> dict:
    result = subprocess.run([sys.executable, *shlex.split(bench), "--json", str(out / f"{tree}.json")],
                            cwd=ROOT / "benchmarks", capture_output=True, text=True)
    (out / f"{tree}.log").write_text("\n".join((result.stdout + result.stderr).splitlines()[-40:]) + "\n")
    if result.returncode != 0:
        raise SystemExit(f"{tree}: the benchmark exited {result.returncode}; see {out / f'{tree}.log'}")
    return json.loads((out / f"{tree}.json").read_text())


def patch(path: Path, reverse: bool = False) -> None:
    subprocess.run(["patch", "-p1", "-s", "--no-backup-if-mismatch", *(["-R"] if reverse else []), "-i", str(path)],
                   cwd=ROOT, check=True)


def summary(results: dict[str, dict]) -> list[str]:
    lines = ["| tree | bs | decode step, overlap on: median ms (trials) | floor ms | same tokens | compiles |",
             "|---|---|---|---|---|---|"]
    for tree, result in results.items():
        for row in result.get("rows", []):
            if "on_step_ms" not in row:
                continue
            trials = [t["step_ms"] for t in row["trials"]["on"]]
            floor = f"{row['floor_ms']:.3f}" if "floor_ms" in row else ""
            lines.append(f"| {tree} | {row['bs']} | {row['on_step_ms']:.3f} ({min(trials):.3f}-{max(trials):.3f}) | "
                         f"{floor} | {row['same_tokens']} | {result.get('stats', {}).get('kernel_compiles', '')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bench", required=True, help="a script under benchmarks/ and its arguments, no --json")
    parser.add_argument("patches", type=Path, nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    patches = [p.resolve() for p in args.patches]
    names = ["base"] + [p.name.removesuffix(".patch") for p in patches]
    if len(set(names)) != len(names):
        raise SystemExit(f"two trees would have one name: {names}")
    results, applied = {"base": run(args.bench, args.out, "base")}, []
    try:
        for path, name in zip(patches, names[1:]):
            patch(path)
            applied.append(path)
            results[name] = run(args.bench, args.out, name)
    finally:
        for path in reversed(applied):
            patch(path, reverse=True)
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
