"""Pre-attention fusion, part 2: RoPE of q_pe/k_pe and the latent-cache write become one op."""

from __future__ import annotations

from torch import fx

from encore.passes.fx_utils import call, comes_before, encore, find_op_nodes, get_only_user, is_op, nodes_between, \
    tuple_outputs


class FuseRopeCacheWrite:
    """Per attention layer::

        before                                                  after
        q_rot, k_rot = rotary(pos, q_pe, k_pe, cos_sin, il)     q_rot = rope_cache_write(pos, q_pe, kv_c, k_pe,
        write_latent_cache(kv_c, k_rot, cache)                                           cos_sin, cache, il)

    ``rope_cache_write`` is one Triton kernel on the GPU (the rotated key goes straight to its cache
    slot and never exists as a tensor), the reference math on the CPU. It is placed where the rotary
    was (or right after kv_c, if that comes later), so the cache write moves earlier: the pass does
    not fire if anything in between touches the cache, if the rotated key has any other user, or if
    a user of the rotated query would then precede the fused op.
    """

    def __init__(self) -> None:
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        for rotary in find_op_nodes(graph, encore.rotary.default):
            outs = tuple_outputs(rotary)
            q_rot, k_rot = outs.get(0), outs.get(1)
            write = get_only_user(k_rot) if k_rot is not None else None
            if write is None or not is_op(write, encore.write_latent_cache.default) or write.args[1] is not k_rot:
                continue
            positions, q_pe, k_pe, cos_sin, interleaved = rotary.args
            kv_c, _, cache = write.args
            anchor = kv_c if comes_before(rotary, kv_c) else rotary
            if any(cache in n.all_input_nodes for n in nodes_between(anchor, write)):
                continue
            if q_rot is not None and any(not comes_before(anchor, u) for u in q_rot.users):
                continue
            with graph.inserting_after(anchor):
                fused = call(graph, encore.rope_cache_write.default, positions, q_pe, kv_c, k_pe, cos_sin, cache,
                             interleaved)
            if q_rot is not None:
                q_rot.replace_all_uses_with(fused)
                graph.erase_node(q_rot)
            graph.erase_node(write)
            graph.erase_node(k_rot)
            graph.erase_node(rotary)
            self.matches += 1
