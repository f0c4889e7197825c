"""Pre-attention fusion, part 3 (DECODE graphs): the RoPE + cache write and the decode's latent query
become one op."""

from __future__ import annotations

import operator

from torch import fx

from encore.passes.fx_utils import call, encore, find_op_nodes, is_op, nodes_between


class FuseRopeAbsorb:
    """Per attention layer of a DECODE graph::

        before                                                  after
        q_rot = rope_cache_write(pos, q_pe, kv_c, k_pe,         q_rot, q_lat = rope_absorb(pos, q_nope, q_pe, kv_c,
                                 cos_sin, cache, il, ...)           k_pe, cos_sin, w_kc, cache, il, ...)
        mla_decode(q_nope, q_rot, w_kc, w_vc, cache, out)       mla_decode(q_nope, q_rot, w_kc, w_vc, cache, out,
                                                                           q_lat=q_lat)

    The latent query q_nope · w_kc, which every backend's decode computed first, is computed with the
    RoPE: at one token the two are one launch (``rope_cache_triton.rope_absorb_triton``), whose GEMV
    tiles and RoPE program run side by side where the RoPE kernel and the GEMV ran one after the
    other. The fused op sits right before the decode (w_kc's view of kv_b_proj is made after the
    RoPE), so the cache write moves later: the pass does not fire if anything in between touches the
    cache or if the rotated query has a user other than the decode.
    """

    def __init__(self) -> None:
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        for decode in find_op_nodes(graph, encore.mla_decode.default):
            q_nope, rope, w_kc, w_vc, cache, out = decode.args
            if not is_op(rope, encore.rope_cache_write.default) or decode.kwargs or rope.kwargs or len(rope.users) != 1:
                continue
            positions, q_pe, kv_c, k_pe, cos_sin, rope_cache, interleaved, *norm = rope.args
            if rope_cache is not cache or any(cache in n.all_input_nodes for n in nodes_between(rope, decode)):
                continue
            with graph.inserting_before(decode):
                fused = call(graph, encore.rope_absorb.default, positions, q_nope, q_pe, kv_c, k_pe, cos_sin, w_kc,
                             cache, interleaved, *norm)
                q_rot = call(graph, operator.getitem, fused, 0)
                q_lat = call(graph, operator.getitem, fused, 1)
            decode.args = (q_nope, q_rot, w_kc, w_vc, cache, out)
            decode.kwargs = {"q_lat": q_lat}
            graph.erase_node(rope)
            self.matches += 1
