from __future__ import annotations

import pytest

from encore.graphs.weights import colocate_pre_attention_weights
from encore.passes.pipeline import passes_for
from graph_helpers import PADDED_KEYS, engine_with_history, run_pipeline


@pytest.fixture(scope="session")
def history(checkpoint):
    """history(kind, colocated=False) -> (engine, batches): one eager engine per kind and weight layout,
    shared (pass tests only re-write cache slots with the values they already hold)."""
    made = {}

    def get(kind: str, colocated: bool = False):
        if (kind, colocated) not in made:
            engine, batches = engine_with_history(checkpoint(kind))
            if colocated:
                assert colocate_pre_attention_weights(engine.runner.model) == engine.model_config.num_hidden_layers
            made[kind, colocated] = engine, batches
        return made[kind, colocated]

    return get


@pytest.fixture(scope="session")
def pipeline(history):
    """pipeline(kind, mode) -> (PipelineRun, layers): the production pass pipeline run once on the
    family graph of that mode, traced and executed on a padded step (key PADDED_KEYS[mode]), every
    stage kept."""
    made = {}

    def get(kind: str, mode: str):
        if (kind, mode) not in made:
            engine, batches = history(kind, colocated=True)
            key = PADDED_KEYS[mode]
            made[kind, mode] = run_pipeline(engine, batches[mode], key, passes_for(key.mode)), \
                engine.model_config.num_hidden_layers
        return made[kind, mode]

    return get
