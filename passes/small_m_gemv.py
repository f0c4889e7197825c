"""Small-M GEMV: a DECODE graph's weight GEMMs become ``encore::dense``, which runs a step of a few
tokens through a Triton GEMV (backends/dense.py)."""

from __future__ import annotations

from torch import fx

from encore.backends.dense import use_gemv
from encore.passes.fx_utils import aten, call, encore, find_op_nodes, is_op, val


class SmallMGemv:
    """Per GEMM of an activation with a weight (a graph input, or the ``as_strided`` view of weights
    that ``FuseQkvAProj`` makes) that the GEMV runs faster (``dense.use_gemv``: its layout, its size)::

        before                                        after
        o = mm(x, t(w))            [T, N]             o = dense(x, w)            [T, N]

    T stays symbolic: ``dense`` picks the GEMV or ``torch.mm`` by the step's T when it runs, so one
    graph still serves every key of the family. Only in DECODE graphs, whose T is the batch times the
    decode q_len (the GEMV runs at up to ``dense.GEMV_TOKENS`` of them); MIXED and EXTEND steps carry
    prompt tokens, where it never runs. The attention's absorbed per-head products are inside its ops
    and stay as they are.
    """

    def __init__(self) -> None:
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        for mm in find_op_nodes(graph, aten.mm.default):
            x, transpose = mm.args
            if not (is_op(transpose, aten.t.default) and _is_weight(transpose.args[0])
                    and use_gemv(val(x), val(transpose.args[0]))):
                continue
            with graph.inserting_before(mm):
                projected = call(graph, encore.dense.default, x, transpose.args[0])
            mm.replace_all_uses_with(projected)
            graph.erase_node(mm)
            if not transpose.users:
                graph.erase_node(transpose)
            self.matches += 1


def _is_weight(node: fx.Node) -> bool:
    return node.op == "placeholder" or (is_op(node, aten.as_strided.default) and node.args[0].op == "placeholder")
