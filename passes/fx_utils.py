"""Small FX predicates and edits shared by the passes (one place, so each pass reads as its pattern)."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten
encore = torch.ops.encore


def is_op(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


def find_op_nodes(graph: fx.Graph, *targets: Any) -> Iterator[fx.Node]:
    """Nodes calling any of ``targets``, in graph order (a snapshot: safe to edit while iterating)."""
    return iter([n for n in graph.nodes if is_op(n, *targets)])


def get_only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def tuple_outputs(node: fx.Node) -> dict[int, fx.Node]:
    """The ``getitem`` users of a multi-output node, by index (only if every user is one)."""
    outs = {}
    for user in node.users:
        if not (is_op(user, operator.getitem) and isinstance(user.args[1], int)):
            return {}
        outs[user.args[1]] = user
    return outs


def val(node: fx.Node) -> Any:
    """The fake value make_fx recorded for ``node`` (shapes, dtype, strides, storage)."""
    return node.meta["val"]


def call(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """Inserts ``target(*args, **kwargs)`` at the graph's insert point, with its fake ``meta["val"]``."""
    node = graph.call_function(target, args, kwargs)
    with fake_mode_of(graph):
        node.meta["val"] = target(*fx.node.map_arg(args, val), **fx.node.map_arg(kwargs, val))
    return node


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's recorded values (make_fx traced it under one)."""
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.fake_mode
    raise ValueError("graph has no fake values in meta['val']; passes need a graph traced by make_fx")


def step_size(graph: fx.Graph, name: str) -> fx.Node | None:
    """The graph input that binds the step size ``name`` (graphs/compiler.py tags it in
    ``meta["step_size"]``), or None if the graph has none."""
    return next((n for n in graph.find_nodes(op="placeholder") if n.meta.get("step_size") == name), None)


def size_arg(graph: fx.Graph, size: int | torch.SymInt) -> int | fx.Node | None:
    """``size`` as a node argument: an int as is, a symbolic size as the graph input that binds it
    (inputs come first, so it is defined wherever it is used); None if no input binds it alone."""
    if not isinstance(size, torch.SymInt):
        return size
    expr = size.node.expr
    return next((n for n in graph.find_nodes(op="placeholder")
                 if isinstance(n.meta.get("val"), torch.SymInt) and n.meta["val"].node.expr == expr), None)


def uses_after(node: fx.Node, anchor: fx.Node) -> list[fx.Node]:
    """Users of ``node`` that come after ``anchor`` in graph order."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    return [u for u in node.users if order[u] > order[anchor]]


def nodes_between(start: fx.Node, end: fx.Node) -> Iterator[fx.Node]:
    """Nodes strictly after ``start`` and strictly before ``end``."""
    node = start.next
    while node is not end and node.op != "root":
        yield node
        node = node.next


def adjacent_rows(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``second``'s rows directly follow ``first``'s in one contiguous storage (real or fake
    tensors: a storage's ``_cdata`` is the same for every view of it)."""
    return (first.is_contiguous() and second.is_contiguous() and first.shape[1:] == second.shape[1:]
            and first.untyped_storage()._cdata == second.untyped_storage()._cdata
            and second.storage_offset() == first.storage_offset() + first.numel())


def comes_before(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` precedes ``b`` in graph order."""
    node = a.next
    while node.op != "root":
        if node is b:
            return True
        node = node.next
    return False
