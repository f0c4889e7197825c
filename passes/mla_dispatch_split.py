"""MLA dispatch split: the generic attention op becomes the family's prefill and decode branches."""

from __future__ import annotations

import operator

from torch import fx

from encore.backends.metadata import ForwardMode
from encore.graphs.compiler import NUM_EXTEND_TOKENS
from encore.passes.fx_utils import aten, call, encore, find_op_nodes, size_arg, step_size, uses_after, val


class MlaDispatchSplit:
    """Per attention layer of a graph of family ``mode``, over the step's T tokens of which the first
    n are prefill tokens (both symbolic: graph inputs, so one graph serves every key of the family)::

        before                                        after (MIXED)
        out = empty([T, H, dv])                       out_p = empty([n, H, dv])
        mla_attention(q_nope, q_pe, w_kc, w_vc,       mla_prefill(q_nope[:n], q_pe[:n], w_kc, w_vc, cache, out_p)
                      cache, out)                     out_d = empty([T - n, H, dv])
        ... uses of out                               mla_decode(q_nope[n:T], q_pe[n:T], w_kc, w_vc, cache, out_d)
                                                      merged = cat([out_p, out_d])
                                                      ... uses of merged

    A DECODE graph gets ``mla_decode`` alone over all tokens (no prefill branch at all), an EXTEND
    graph ``mla_prefill`` alone. T - n is computed once, right after the graph's inputs. The MIXED
    form is correct on its own; the shared-o_proj pass then removes the concatenation. Raises if a
    MIXED graph does not take n and T as inputs (graphs/compiler.py traces MIXED steps so).
    """

    def __init__(self, mode: ForwardMode) -> None:
        self.mode = mode
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        attns = list(find_op_nodes(graph, encore.mla_attention.default))
        if self.mode is not ForwardMode.MIXED:
            branch = encore.mla_prefill.default if self.mode is ForwardMode.EXTEND else encore.mla_decode.default
            for attn in attns:
                attn.target = branch
            self.matches = len(attns)
            return
        if not attns:
            return
        n = step_size(graph, NUM_EXTEND_TOKENS)
        total = size_arg(graph, val(attns[0].args[0]).shape[0])
        if n is None or total is None:
            raise ValueError("a MIXED graph must take its token count and prefill-token count as symbolic inputs "
                             f"(got prefill tokens {n}, tokens {total}): trace it through graphs/compiler.py")
        with graph.inserting_after(list(graph.find_nodes(op="placeholder"))[-1]):
            num_decode = call(graph, operator.sub, total, n)
        for attn in attns:
            self._split(graph, attn, n, num_decode, total)
            self.matches += 1

    @staticmethod
    def _split(graph: fx.Graph, attn: fx.Node, n: fx.Node, num_decode: fx.Node, total: fx.Node) -> None:
        q_nope, q_pe, w_kc, w_vc, cache, out = attn.args
        out_val = val(out)
        later_uses = uses_after(out, attn)
        with graph.inserting_before(attn):
            branches = []
            for target, size, lo, hi in ((encore.mla_prefill.default, n, 0, n),
                                         (encore.mla_decode.default, num_decode, n, total)):
                buf = call(graph, aten.empty.memory_format, [size, *out_val.shape[1:]], dtype=out_val.dtype,
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
