"""Norms into their consumers: a DECODE graph's RMSNorms (and the residual add before one) go into the
op that reads the normed row: the GEMV, the router, or the RoPE + cache write."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from encore.passes.fx_utils import aten, call, comes_before, encore, find_op_nodes, is_op, tuple_outputs, val


@dataclass(frozen=True)
class NormMatch:
    """``weight * rms_norm(x)`` as traced (``dense.rms_norm``): x, the weight, eps, and the nodes that
    compute it from x (x itself not among them), last first."""

    x: fx.Node
    weight: fx.Node
    eps: float
    nodes: tuple[fx.Node, ...]


class FuseNorms:
    """Per RMSNorm whose normed row has one user, an ``encore::dense`` (a layer's input norm, the dense
    MLP's post-attention norm, V3's q_a norm) or the RoPE + cache write (the kv norm), or that a MoE
    layer's ``route`` reads first (its post-attention norm)::

        before                                        after
        h = add(r, d)                [T, K]           o, h = add_rms_norm_dense(r, d, nw, eps, w)
        n = nw * rms_norm(h, eps)    (7-9 nodes)
        o = dense(n, w)              [T, N]

        h = add(r, d)                                 wt, ids, n, h = add_rms_norm_route(r, d, nw, eps,
        n = nw * rms_norm(h, eps)                                                        rw, ...)
        wt, ids = route(n, rw, ...)                   routed_experts(n, ..., wt, ids, ...)
        routed_experts(n, ..., wt, ids, ...)

        n = nw * rms_norm(kv_c, eps)                  q_rot = rope_cache_write(..., kv_c, ..., il, nw, eps)
        q_rot = rope_cache_write(..., n, ..., il)

    and without the add (the first layer's input, or an add whose sum the graph reads before the
    GEMV): ``o = rms_norm_dense(x, nw, eps, w)``. On CUDA each is one launch where there were two: at
    the token counts where the GEMV runs, the kernel before releases it early and it reads its weights
    while that kernel finishes instead of after a norm kernel (other token counts run a Triton norm
    and cuBLAS); the RoPE kernel normalizes its token's row before writing it. The fused op takes the
    dense's or the route's place; every other user of the sum (the next residual add) and of the
    normed row (the experts) must come after it, or nothing fuses. DECODE graphs only, after
    SmallMGemv.
    """

    def __init__(self) -> None:
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        for node in find_op_nodes(graph, encore.dense.default, encore.route.default, encore.rope_cache_write.default):
            self.matches += _FUSE_INTO[node.target](graph, node)


def _into_dense(graph: fx.Graph, projection: fx.Node) -> bool:
    normed, w = projection.args
    norm = match_rms_norm(normed)
    if norm is None or len(normed.users) != 1:
        return False
    total = norm.x
    fuse_add = _fusable_add(norm, projection)
    new_total = None
    with graph.inserting_before(projection):
        if fuse_add:
            fused = call(graph, encore.add_rms_norm_dense.default, *total.args, norm.weight, norm.eps, w)
            out, new_total = (call(graph, operator.getitem, fused, i) for i in (0, 1))
        else:
            out = call(graph, encore.rms_norm_dense.default, total, norm.weight, norm.eps, w)
    projection.replace_all_uses_with(out)
    graph.erase_node(projection)
    _drop_norm(graph, norm, new_total)
    return True


def _into_route(graph: fx.Graph, router: fx.Node) -> bool:
    normed = router.args[0]
    norm = match_rms_norm(normed)
    if norm is None or not tuple_outputs(router) or not _fusable_add(norm, router) or not all(
            u is router or comes_before(router, u) for u in normed.users):
        return False
    total = norm.x
    with graph.inserting_before(router):
        fused = call(graph, encore.add_rms_norm_route.default, *total.args, norm.weight, norm.eps, *router.args[1:])
        new_normed, new_total = (call(graph, operator.getitem, fused, i) for i in (2, 3))
    for user in list(router.users):  # the getitems of the weights and ids
        user.args = (fused, user.args[1])
    graph.erase_node(router)
    normed.replace_all_uses_with(new_normed)
    _drop_norm(graph, norm, new_total)
    return True


def _fusable_add(norm: NormMatch, anchor: fx.Node) -> bool:
    """Whether the norm's x is a residual add of two like rows, all of whose users outside the norm
    come after ``anchor`` (where the fused op goes)."""
    total = norm.x
    return (is_op(total, aten.add.Tensor) and not total.kwargs and len(total.args) == 2
            and all(isinstance(a, fx.Node) and _same_layout(val(a), val(total)) for a in total.args)
            and all(u in norm.nodes or comes_before(anchor, u) for u in total.users))


def _into_rope(graph: fx.Graph, rope: fx.Node) -> bool:
    normed = rope.args[2]
    norm = match_rms_norm(normed)
    # rope's positional arguments end before its optional kv norm's (more: it already has one)
    norm_at = [a.name for a in rope.target._schema.arguments].index("kv_norm_weight")
    if norm is None or len(normed.users) != 1 or len(rope.args) != norm_at or rope.kwargs:
        return False
    args = list(rope.args)
    args[2] = norm.x
    rope.args = (*args, norm.weight, norm.eps)
    _drop_norm(graph, norm, None)
    return True


def _drop_norm(graph: fx.Graph, norm: NormMatch, new_total: fx.Node | None) -> None:
    """Erases the norm's nodes (their users rewired already) and, given the fused op's sum, the add
    whose users it takes."""
    for node in norm.nodes:
        graph.erase_node(node)
    if new_total is not None:
        norm.x.replace_all_uses_with(new_total)
        graph.erase_node(norm.x)


_FUSE_INTO = {encore.dense.default: _into_dense, encore.route.default: _into_route,
              encore.rope_cache_write.default: _into_rope}


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.dim() == 2 and a.stride(1) == 1


def match_rms_norm(node: fx.Node) -> NormMatch | None:
    """``node`` as ``weight * rms_norm(x, eps)`` traced to ATen (``dense.rms_norm``): mul(weight, cast?(mul(xf,
    rsqrt(add(mean(pow(xf, 2), [-1], True), eps))))), xf = x cast to float32 (x itself if float32), the
    casts back to x's dtype; the weight a graph input of x's dtype and last size. None otherwise, or if
    a node inside has a user outside."""
    if not _is(node, aten.mul.Tensor):
        return None
    weight, scaled = node.args if _is_input(node.args[0]) else node.args[::-1]
    if not (_is_input(weight) and isinstance(scaled, fx.Node)):
        return None
    inner, cast_back = scaled, None
    if _is(scaled, aten._to_copy.default):
        inner, cast_back = scaled.args[0], scaled
    if not _is(inner, aten.mul.Tensor):
        return None
    xf, rsqrt = inner.args if _is(inner.args[1], aten.rsqrt.default) else inner.args[::-1]
    if not (_is(rsqrt, aten.rsqrt.default) and _is(rsqrt.args[0], aten.add.Tensor) and isinstance(xf, fx.Node)):
        return None
    mean, eps = rsqrt.args[0].args
    if not (_is(mean, aten.mean.dim) and isinstance(eps, float) and list(mean.args[1]) in ([-1], [1])
            and mean.args[2:] == (True,) and not mean.kwargs):
        return None
    square = mean.args[0]
    if not (_is(square, aten.pow.Tensor_Scalar) and square.args == (xf, 2)):
        return None
    x, cast = xf, None
    if _is(xf, aten._to_copy.default):
        x, cast = xf.args[0], xf
        if cast.kwargs != {"dtype": torch.float32}:
            return None
    x_val, w_val = val(x), val(weight)
    if not (isinstance(x, fx.Node) and val(xf).dtype == torch.float32 and x_val.dim() == 2
            and w_val.shape == x_val.shape[1:] and w_val.dtype == x_val.dtype == val(node).dtype):
        return None
    if (cast_back is None) != (x_val.dtype == torch.float32) or (
            cast_back is not None and cast_back.kwargs != {"dtype": x_val.dtype}):
        return None
    nodes = [n for n in (node, cast_back, inner, rsqrt, rsqrt.args[0], mean, square, cast) if n is not None]
    inside = set(nodes)
    if any(u not in inside for n in nodes[1:] for u in n.users):
        return None
    return NormMatch(x, weight, eps, tuple(nodes))


def _is(node: object, target: object) -> bool:
    return isinstance(node, fx.Node) and is_op(node, target)


def _is_input(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder"
