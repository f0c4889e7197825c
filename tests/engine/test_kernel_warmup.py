"""Start-up kernel warm-up: once an engine is built, no step compiles a Triton kernel
(backends/kernel_variants.py, ModelRunner.warm_up_kernels)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from encore.engine import Engine
from encore.engine.kv_cache import DUMMY_PAGE
from encore.engine.step import scratch_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_scratch_batch_layout():
    batch = scratch_batch([5, 3], 2, 3, width=4, page_size=4, device=torch.device("cpu"))
    assert (batch.num_extends, batch.bs, batch.num_tokens, batch.q_len_per_req) == (2, 4, 14, 3)
    assert batch.qo_indptr.tolist() == [0, 5, 8, 11, 14]
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu == [5, 3, 3, 3]
    assert batch.prefix_lens.tolist() == [0, 0, 0, 0]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 0, 1, 2]
    # Token p of any row is written where the table (all dummy pages) says position p is read from.
    assert batch.slot_mapping.tolist() == [DUMMY_PAGE * 4 + p % 4 for p in batch.positions.tolist()]
    assert batch.page_table.shape == (4, 4) and (batch.page_table == DUMMY_PAGE).all()
    assert batch.gather_ids.numel() == 0


def test_scratch_batch_rejects_a_table_too_narrow_for_its_rows():
    with pytest.raises(ValueError, match="row of 5 tokens"):
        scratch_batch([5], 0, 1, width=1, page_size=4, device=torch.device("cpu"))


def test_warm_up_runs_nothing_off_cuda(v3_dir):
    lines = []
    engine = Engine(str(v3_dir), device="cpu", page_size=4, on_progress=lines.append)
    assert len(lines) == 1 and lines[0].startswith("weights loaded: ")  # and no warm-up to report
    assert engine.runner.warm_up_kernels(engine.config) == 0
    assert engine.stats()["kernel_compiles"] == 0


# A fresh process: Triton's in-memory kernel cache must not hold variants other tests compiled. A
# fixed KV pool: sized from free memory it would depend on what this process still holds.
CHILD = r"""
import json, sys
from encore.engine import Engine, SamplingParams

progress = []
engine = Engine(device="cuda", max_num_seqs=64, num_kv_pages=4096, compile=False, cuda_graphs=False,
                on_progress=progress.append, **{"dtype": "float32", **json.loads(sys.argv[1])})
start = engine.stats()
greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
sampled = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, ignore_eos=True)  # the race, top-p's search
top_k = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, ignore_eos=True)  # top-k's search too
n = 0
for sizes in ((20, 30, 14), (7, 45, 12), (64,), (3, 5, 9), (1,)):
    for size in sizes:  # arrivals between steps: EXTEND, then MIXED steps of many prefill rows
        for _ in range(size):
            length = 1500 if size == 1 else 1 + (13 * n) % 60  # the last round: one long row
            engine.add_request(f"r{n}", [3 + (7 * n + j) % 200 for j in range(length)], (greedy, sampled, top_k)[n % 3])
            n += 1
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
print(json.dumps({"start": start, "end": engine.stats(), "progress": progress}))
"""


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("options", [{}, {"speculative": {"method": "mtp", "num_speculative_tokens": 2}},
                                     {"dtype": "bfloat16", "attention_backend": "triton"},
                                     {"dtype": "bfloat16", "attention_backend": "triton",
                                      "speculative": {"method": "mtp", "num_speculative_tokens": 3}}],
                         ids=["plain", "mtp-k2", "bf16-triton", "bf16-triton-mtp-k3"])
def test_eager_steps_of_any_shape_compile_no_kernel_gpu(options):
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(options)], capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, child.stderr[-5000:]
    stats = json.loads(child.stdout.strip().splitlines()[-1])
    start, end = stats["start"], stats["end"]
    loaded, first, last = stats["progress"]  # encore serve's lines: the weights, then around the warm-up
    assert re.fullmatch(r"weights loaded: [\d.]+ GB in [\d.]+s", loaded), loaded
    assert first.startswith("warming up the kernels")
    assert re.fullmatch(r"kernel warm-up: \d+ eager steps in [\d.]+s", last), last
    assert end["eager_steps"] - start["eager_steps"] > 20 and end["steps"]["MIXED"] > 0, end
    assert start["kernel_compiles"] == end["kernel_compiles"] == 0, end
    assert end["kv_pages_free"] == end["kv_pages_total"]
