from __future__ import annotations

import pytest

from checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(kind) -> directory of a tiny random HF checkpoint (cached per session)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = write_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def v3_dir(checkpoint):
    return checkpoint("v3")
