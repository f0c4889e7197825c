"""Pre-attention fusion, part 1: the query projection and kv_a_proj_with_mqa become one GEMM."""

from __future__ import annotations

import math

from torch import fx
from torch._prims_common import make_contiguous_strides_for

from encore.passes.fx_utils import (adjacent_rows, aten, call, comes_before, encore, find_op_nodes, is_op,
                                   size_arg, tuple_outputs, val)


class FuseQkvAProj:
    """Per attention layer (``w_q`` is q_a_proj's weight for q-LoRA models, q_proj's otherwise)::

        before                                        after
        q  = mm(x, t(w_q))            [T, Nq]         w   = as_strided(w_q, [Nq + L, H], [H, 1], off(w_q))
        kv = mm(x, t(w_kv))           [T, L]          qkv = mm(x, t(w))                  [T, Nq + L]
        kv_c, k_pe = split(kv, [R, dr])               q   = slice(qkv, 1, 0, Nq)
        q_heads = view(q, [T, H, D])                  kv  = slice(qkv, 1, Nq, Nq + L)
                                                      q_heads = as_strided(qkv, [T, H, D], [Nq + L, D, 1], 0)

    ``kv`` is recognized by its use: the rope part of its split is the ``k_pe`` of a ``rotary`` or
    ``rope_cache_write``. The pass fires only where ``w_kv``'s rows directly follow ``w_q``'s in one
    storage (``graphs/weights.py`` lays them out so): the fused weight is then a view, and nothing is
    copied at run time. Bias-free projections only (DeepSeek's have none).

    A view of ``q`` into heads (models without q-LoRA) becomes an ``as_strided`` of ``qkv``: the view
    of a column slice makes fake-tensor stride reasoning guard on T != 1 (T is symbolic), so a family
    traced at T > 1 would recompile for its bs=1 key; ``as_strided`` states the same strides outright.
    """

    def __init__(self) -> None:
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        for kv_mm in find_op_nodes(graph, aten.mm.default):
            q_mm = self._query_partner(kv_mm)
            if q_mm is None:
                continue
            x, w_q, w_kv = q_mm.args[0], q_mm.args[1].args[0], kv_mm.args[1].args[0]
            num_q, width = val(w_q).shape
            total = num_q + val(w_kv).shape[0]
            first = q_mm if comes_before(q_mm, kv_mm) else kv_mm
            with graph.inserting_before(first):
                fused_w = call(graph, aten.as_strided.default, w_q, [total, width], [width, 1],
                               val(w_q).storage_offset())
                qkv = call(graph, aten.mm.default, x, call(graph, aten.t.default, fused_w))
                q = call(graph, aten.slice.Tensor, qkv, 1, 0, num_q)
                kv = call(graph, aten.slice.Tensor, qkv, 1, num_q, total)
            for old, new in ((q_mm, q), (kv_mm, kv)):
                transpose = old.args[1]
                old.replace_all_uses_with(new)
                graph.erase_node(old)
                if not transpose.users:
                    graph.erase_node(transpose)
            _heads_as_strided(graph, q, qkv, total)
            self.matches += 1

    def _query_partner(self, kv_mm: fx.Node) -> fx.Node | None:
        """The query mm fused with ``kv_mm`` if ``kv_mm`` is a kv_a projection with an adjacent partner."""
        if not (_weight_placeholder(kv_mm) and _feeds_k_pe(kv_mm)):
            return None
        x, w_kv = kv_mm.args[0], val(kv_mm.args[1].args[0])
        for user in x.users:
            if user is kv_mm or not is_op(user, aten.mm.default) or user.args[0] is not x:
                continue
            if _weight_placeholder(user) and adjacent_rows(val(user.args[1].args[0]), w_kv):
                return user
        return None


def _heads_as_strided(graph: fx.Graph, q: fx.Node, qkv: fx.Node, row_stride: int) -> None:
    """Each view of ``q`` [T, Nq] (columns 0..Nq of ``qkv``) into [T, *heads] -> as_strided of ``qkv``."""
    num_q = val(q).shape[1]
    for view in [u for u in q.users if is_op(u, aten.view.default)]:
        tokens, heads = size_arg(graph, val(view).shape[0]), val(view).shape[1:]
        if tokens is None or not all(isinstance(d, int) for d in heads) or math.prod(heads) != num_q:
            continue  # not a split of the query columns into heads
        with graph.inserting_before(view):
            strided = call(graph, aten.as_strided.default, qkv, [tokens, *heads],
                           [row_stride, *make_contiguous_strides_for(heads)], 0)
        view.replace_all_uses_with(strided)
        graph.erase_node(view)


def _weight_placeholder(mm: fx.Node) -> bool:
    weight = mm.args[1]
    return is_op(weight, aten.t.default) and weight.args[0].op == "placeholder"


def _feeds_k_pe(kv_mm: fx.Node) -> bool:
    for split in kv_mm.users:
        if not is_op(split, aten.split_with_sizes.default) or len(split.args[1]) != 2:
            continue
        k_pe = tuple_outputs(split).get(1)
        if k_pe is None:
            continue
        for user in k_pe.users:
            if is_op(user, encore.rotary.default) and user.args[2] is k_pe:
                return True
            if is_op(user, encore.rope_cache_write.default) and user.args[3] is k_pe:
                return True
    return False

