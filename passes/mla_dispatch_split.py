"""MLA dispatch split: the generic attention op becomes the key's prefill and decode branches."""

from __future__ import annotations

from torch import fx

from encore.graphs.keys import GraphKey
from encore.passes.fx_utils import aten, call, encore, find_op_nodes, uses_after, val


class MlaDispatchSplit:
    """Per attention layer, for graph key ``key`` with n = key.num_extend_tokens of T tokens::

        before                                        after (MIXED)
        out = empty([T, H, dv])                       out_p = empty([n, H, dv])
        mla_attention(q_nope, q_pe, w_kc, w_vc,       mla_prefill(q_nope[:n], q_pe[:n], w_kc, w_vc, cache, out_p)
                      cache, out)                     out_d = empty([T - n, H, dv])
        ... uses of out                               mla_decode(q_nope[n:], q_pe[n:], w_kc, w_vc, cache, out_d)
                                                      merged = cat([out_p, out_d])
                                                      ... uses of merged

    A DECODE key's graph gets ``mla_decode`` alone over all tokens (no prefill branch at all), an
    EXTEND key's ``mla_prefill`` alone. The MIXED form is correct on its own; the shared-o_proj pass
    then removes the concatenation. Raises if a graph's token count is not the key's (it was traced
    for another key).
    """

    def __init__(self, key: GraphKey) -> None:
        self.key = key
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        key = self.key
        for attn in find_op_nodes(graph, encore.mla_attention.default):
            q_nope, q_pe, w_kc, w_vc, cache, out = attn.args
            if val(q_nope).shape[0] != key.num_tokens:
                raise ValueError(f"mla_attention over {val(q_nope).shape[0]} tokens in a graph for key {key}")
            if key.num_decodes == 0 or key.num_extends == 0:
                attn.target = encore.mla_prefill.default if key.num_decodes == 0 else encore.mla_decode.default
                self.matches += 1
                continue
            n, total = key.num_extend_tokens, key.num_tokens
            out_val = val(out)
            later_uses = uses_after(out, attn)
            with graph.inserting_before(attn):
                branches = []
                for target, lo, hi in ((encore.mla_prefill.default, 0, n), (encore.mla_decode.default, n, total)):
                    buf = call(graph, aten.empty.memory_format, [hi - lo, *out_val.shape[1:]], dtype=out_val.dtype,
                               device=out_val.device)
                    call(graph, target, call(graph, aten.slice.Tensor, q_nope, 0, lo, hi),
                         call(graph, aten.slice.Tensor, q_pe, 0, lo, hi), w_kc, w_vc, cache, buf)
                    branches.append(buf)
                merged = call(graph, aten.cat.default, branches)
            for use in later_uses:
                use.replace_input_with(out, merged)
            graph.erase_node(attn)
            if not out.users:
                graph.erase_node(out)
            self.matches += 1
