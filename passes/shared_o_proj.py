"""Shared o_proj: both attention branches write into one preallocated output that o_proj reads."""

from __future__ import annotations

from torch import fx

from encore.passes.fx_utils import aten, call, encore, find_op_nodes, is_op, size_arg, val


class SharedOProj:
    """Per attention layer of a MIXED graph (after the dispatch split)::

        before                                        after
        out_p = empty([n, H, dv])                     out = empty([T, H, dv])
        mla_prefill(..., out_p)                       mla_prefill(..., out[:n])
        out_d = empty([T - n, H, dv])                 mla_decode(..., out[n:])
        mla_decode(..., out_d)                        o = mm(view(out), t(w_o))
        o = mm(view(cat([out_p, out_d])), t(w_o))

    No concatenation and no copy: each branch writes its rows of the buffer in place, and the one
    o_proj GEMM reads it. n and T may be symbolic: the buffer and its slices then take them from the
    graph inputs that bind them. Fires only on a ``cat`` along tokens of exactly two graph-allocated buffers,
    each written by one attention branch (prefill first) and read by nothing but the ``cat``.
    """

    def __init__(self) -> None:
        self.matches = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.matches = 0
        for cat in find_op_nodes(graph, aten.cat.default):
            parts = cat.args[0]
            dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
            if dim != 0 or len(parts) != 2:
                continue
            writers = [_only_writer(part, cat) for part in parts]
            if not (writers[0] is not None and writers[1] is not None
                    and is_op(writers[0], encore.mla_prefill.default) and is_op(writers[1], encore.mla_decode.default)):
                continue
            merged_val = val(cat)
            n, shape = size_arg(graph, val(parts[0]).shape[0]), [size_arg(graph, s) for s in merged_val.shape]
            if n is None or any(size is None for size in shape):  # a size no graph input binds
                continue
            total = shape[0]
            with graph.inserting_before(parts[0]):
                out = call(graph, aten.empty.memory_format, shape, dtype=merged_val.dtype, device=merged_val.device)
            for writer, part, (lo, hi) in zip(writers, parts, ((0, n), (n, total))):
                with graph.inserting_before(writer):
                    writer.replace_input_with(part, call(graph, aten.slice.Tensor, out, 0, lo, hi))
            cat.replace_all_uses_with(out)
            graph.erase_node(cat)
            for part in parts:
                graph.erase_node(part)
            self.matches += 1


def _only_writer(buf: fx.Node, cat: fx.Node) -> fx.Node | None:
    """The one attention op writing ``buf`` (as its ``out``), if ``buf`` is an ``empty`` used only by
    that op and ``cat``."""
    if not is_op(buf, aten.empty.memory_format) or len(buf.users) != 2 or cat not in buf.users:
        return None
    writer = next(u for u in buf.users if u is not cat)
    if is_op(writer, encore.mla_prefill.default, encore.mla_decode.default) and writer.args[5] is buf:
        return writer
    return None
