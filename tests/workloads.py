"""Request arrival patterns shared by the engine, graph and speculative tests."""

from __future__ import annotations

from collections.abc import Sequence

from encore.engine import Engine, RequestOutput, SamplingParams


def run_staggered(engine: Engine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams],
                  arrivals: Sequence[int], prefix: str = "r") -> dict[str, RequestOutput]:
    """Adds prompt i (as request f"{prefix}{i}") at step arrivals[i], steps until all finish;
    returns each request's final output."""
    per_prompt = params if isinstance(params, Sequence) else [params] * len(prompts)
    done: dict[str, RequestOutput] = {}
    step = 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(f"{prefix}{i}", prompts[i], per_prompt[i])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done
