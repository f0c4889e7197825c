"""encore.engine: requests, scheduling, the paged latent KV cache, sampling and the engine loop."""

from encore.engine.engine import Engine
from encore.engine.request import RequestOutput
from encore.engine.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
