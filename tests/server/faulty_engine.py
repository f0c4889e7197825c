"""An Engine whose step fails while a request with the poison prompt is in it (spawned engine
processes import this module by name, so it lives outside conftest)."""

from __future__ import annotations

from encore.engine import Engine

POISON = [7, 7, 7, 7]


class FaultyEngine(Engine):
    def step(self):
        if any(req.prompt_token_ids == POISON and not req.finished for req in self.requests.values()):
            raise RuntimeError("injected fault")
        return super().step()
