"""The passes a graph key's graph goes through, in order (passes/README.md says why this order)."""

from __future__ import annotations

from encore.graphs.keys import GraphKey
from encore.passes.fuse_qkv_a_proj import FuseQkvAProj
from encore.passes.fuse_rope_cache_write import FuseRopeCacheWrite
from encore.passes.mla_dispatch_split import MlaDispatchSplit
from encore.passes.shared_o_proj import SharedOProj


def passes_for(key: GraphKey) -> list:
    return [FuseQkvAProj(), FuseRopeCacheWrite(), MlaDispatchSplit(key), SharedOProj()]
