"""An Engine that emits one token per running request at a fixed step time, without running the model
(``bench_server_frontend.py``): the server's own costs, apart from the engine's. The spawned engine
process imports it by module name, so it lives in a module of its own."""

from __future__ import annotations

import time

from encore.engine import Engine
from encore.engine.request import RequestOutput

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


class PacedEngine(Engine):
    def __init__(self, step_s: float, **options) -> None:
        super().__init__(**options)  # builds the real model (for start-up and the server's info), unused
        self.step_s = step_s
        self.live: dict[str, list] = {}  # request id -> [prompt ids, max_tokens, tokens emitted]
        self.arrived = 0  # since the last step
        self.text_ids = self.tokenizer.encode(TEXT * 4)  # real text, so detokenization is typical
        self.paced_steps = {"EXTEND": 0, "DECODE": 0, "MIXED": 0}

    def add_request(self, request_id, prompt, params) -> None:
        self.live[request_id] = [list(prompt), params.max_tokens, 0]
        self.arrived += 1

    def abort(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def _step(self) -> list[RequestOutput]:
        """A step whose arrivals join running requests counts as MIXED, as the engine's would; it
        replaces ``Engine._step``, so ``Engine.step`` counts its time as it counts a real step's."""
        decoding = any(emitted for _, _, emitted in self.live.values())
        mode = ("MIXED" if decoding else "EXTEND") if self.arrived else "DECODE"
        self.paced_steps[mode] += 1
        self.arrived = 0
        time.sleep(self.step_s)
        outputs = []
        for request_id, row in list(self.live.items()):
            prompt, max_tokens, emitted = row
            row[2] = emitted = emitted + 1
            done = emitted >= max_tokens
            outputs.append(RequestOutput(request_id, prompt, prompt, emitted, "",
                                         [self.text_ids[emitted % len(self.text_ids)]], "", done,
                                         "length" if done else None))
            if done:
                del self.live[request_id]
        return outputs

    def stats(self) -> dict:
        return {**super().stats(), "steps": dict(self.paced_steps)}
