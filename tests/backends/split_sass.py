"""Compiles ``triton_mla._decode_split_kernel`` for sm90 (no GPU needed: Triton's own ptxas) at V2-Lite's
attention (16 heads, rank 512 + 64, bf16, page size 64), rows of 1, 2 and 4 tokens, with each launch
setting ``decode_configs`` lists, and prints a JSON object: for each "q_len,block_m,block_n,warps,stages" the
registers a thread, the count of tensor-core MMAs (HMMA, or HGMMA for warpgroup MMAs), the longest
chain of HMMAs each accumulating onto the one before, and the global loads before the wait of a kernel
launched as a programmatic dependent (one token's, as bs 1 launches it on sm90+). Run in a child process
by test_triton_mla.py: the CPU tests' interpreter mode cannot compile."""

from __future__ import annotations

import json
import re
import sys

import torch
from sass import compile_sass

from encore.backends.triton_mla import _decode_split_kernel, decode_configs, decode_r_chunk

ARGS = ["Q", "QPE", "KV", "PAGE_TABLE", "SEQ_LENS", "OUT", "PART_O", "PART_LSE", "qk_scale", "stride_qt",
        "stride_qh", "stride_pet", "stride_peh", "stride_kvp", "stride_kvs", "stride_ptb", "stride_ot", "stride_oh",
        "num_splits"]
TYPES = {"Q": "*bf16", "QPE": "*bf16", "KV": "*bf16", "PAGE_TABLE": "*i32", "SEQ_LENS": "*i32", "OUT": "*bf16",
         "PART_O": "*fp32", "PART_LSE": "*fp32", "qk_scale": "fp32"}
# What a launch specializes: the data pointers 16-byte aligned, the strides (multiples of 16 here) divisible
# by 16; num_splits, stride_ptb and the index pointers are not specialized on.
ALIGNED = {"Q", "QPE", "KV", "OUT", "PART_O", "PART_LSE", "stride_qt", "stride_qh", "stride_pet", "stride_peh",
           "stride_kvp", "stride_kvs", "stride_ot", "stride_oh"}


def longest_chain(sass: str) -> int:
    """The longest run of HMMAs in which each one's accumulator (its fourth operand) is the register the
    one before wrote, in program order."""
    depth, best = {}, 0
    for operands in re.findall(r"HMMA\.\S+\s+([^;]+);", sass):
        dst, _, _, acc = (o.strip() for o in operands.split(","))
        depth[dst] = 1 if acc == "RZ" else depth.get(acc, 0) + 1
        best = max(best, depth[dst])
    return best


def loads_before_wait(sass: str) -> int | None:
    """Global loads (LDG) before the programmatic-dependent wait (ACQBULK); None if the kernel never waits."""
    wait = sass.find("ACQBULK")
    return None if wait < 0 else len(re.findall(r"\bLDG\.", sass[:wait]))


def main() -> None:
    signature = {a: TYPES.get(a, "i32") for a in ARGS}
    found = {}
    for q_len, config in ((q, c) for q in (1, 2, 4) for c in decode_configs(16, q, torch.bfloat16)):
        constants = dict(NUM_HEADS=16, Q_LEN=q_len, PAGE_SIZE=64, R=512, DR=64, R_CHUNK=decode_r_chunk(config, 512),
                         BLOCK_DR=64, BLOCK_M=config.block_m, BLOCK_N=config.block_n, DIRECT=False, PRECISION="tf32",
                         RELEASE=True, DEPENDENT=q_len == 1)  # one token: as bs 1 launches it on sm90+
        sass, registers = compile_sass(_decode_split_kernel, signature, ALIGNED, constants, config.num_warps,
                                       config.num_stages)
        key = f"{q_len},{config.block_m},{config.block_n},{config.num_warps},{config.num_stages}"
        found[key] = {"registers": registers, "hmma": len(re.findall(r"\bHMMA\.", sass)),
                      "hgmma": len(re.findall(r"\bHGMMA\.", sass)), "longest_chain": longest_chain(sass),
                      "loads_before_wait": loads_before_wait(sass)}
    json.dump(found, sys.stdout)


if __name__ == "__main__":
    main()
