"""Engines that fail: one whose step fails while a request with the poison prompt is in it, one that
never finishes starting (spawned engine processes import this module by name, so it lives outside
conftest)."""

from __future__ import annotations

import threading

from encore.engine import Engine

POISON = [7, 7, 7, 7]


class FaultyEngine(Engine):
    def step(self):
        if any(req.prompt_token_ids == POISON and not req.finished for req in self.requests.values()):
            raise RuntimeError("injected fault")
        return super().step()


class StuckEngine:
    """Never finishes starting, as an engine still loading its weights or compiling its graphs."""

    def __init__(self, **kwargs) -> None:
        threading.Event().wait()
