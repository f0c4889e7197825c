"""encore.engine: requests, scheduling, the paged latent KV cache, sampling and the engine loop.

Engine, RequestOutput and SamplingParams are imported on first use, not with the package: ``encore
serve`` reads its options (encore.engine.cli_options) and spawns the engine process before it imports
torch, so that the two processes' imports overlap (server/engine_spawn.py)."""

import importlib

_EXPORTS = {"Engine": "encore.engine.engine", "RequestOutput": "encore.engine.request",
            "SamplingParams": "encore.engine.sampling_params"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)  # found directly next time
    return value
