"""The passes a graph family's graph goes through, in order (passes/README.md says why this order)."""

from __future__ import annotations

from encore.backends.metadata import ForwardMode
from encore.passes.fuse_norms import FuseNorms
from encore.passes.fuse_qkv_a_proj import FuseQkvAProj
from encore.passes.fuse_rope_absorb import FuseRopeAbsorb
from encore.passes.fuse_rope_cache_write import FuseRopeCacheWrite
from encore.passes.mla_dispatch_split import MlaDispatchSplit
from encore.passes.shared_o_proj import SharedOProj
from encore.passes.small_m_gemv import SmallMGemv


def passes_for(family: ForwardMode) -> list:
    passes = [FuseQkvAProj(), FuseRopeCacheWrite(), MlaDispatchSplit(family), SharedOProj()]
    return passes + [SmallMGemv(), FuseNorms(), FuseRopeAbsorb()] if family is ForwardMode.DECODE else passes
