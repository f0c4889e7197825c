"""The step context: where encore's custom ops find the step they run in.

Attention, cache-write and RoPE-with-cache-write are ``torch.library.custom_op``'s, and a custom op
cannot take a ``ForwardBatch`` (or a planned flashinfer wrapper) as an argument. So the runner binds
the step before running the model and the ops read it back:

    with runner.context.bind(batch):       # the one place it is set, and reset
        hidden = model(input_ids, positions, batch)

One ``StepContext`` per ``ModelRunner`` (it owns it, with the backend). The active context is held in a
``ContextVar`` rather than a module global, so two runners in one process (a target and its drafter,
or an eager and a compiled engine in a test) never see each other's steps.

Inside a CUDA graph the ops run once, at capture, with the static buffers bound; replays reuse the
addresses they read then, which is why the graph runner binds its static batch, never a fresh one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from encore.backends.base import AttentionBackend
    from encore.backends.metadata import ForwardBatch

_ACTIVE: ContextVar[StepContext | None] = ContextVar("encore_step_context", default=None)


class StepContext:
    """The backend and the step it is running; ``batch`` is set only inside ``bind``."""

    __slots__ = ("backend", "batch")

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.batch: ForwardBatch | None = None

    @contextmanager
    def bind(self, batch: ForwardBatch) -> Iterator[StepContext]:
        if self.batch is not None:
            raise RuntimeError("StepContext.bind is not reentrant: a step is already bound")
        self.batch = batch
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)
            self.batch = None


def current_step() -> StepContext:
    """The bound context; raises if an op runs outside ``StepContext.bind``."""
    ctx = _ACTIVE.get()
    if ctx is None or ctx.batch is None:
        raise RuntimeError("an encore attention op ran outside a step: run the model through "
                           "ModelRunner.forward, or inside StepContext.bind(batch)")
    return ctx
