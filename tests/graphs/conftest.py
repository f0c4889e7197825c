from __future__ import annotations

import io

import pytest

from encore.graphs.warmup import warmup
from graph_helpers import SMALL_KEYS, STAGGERED


@pytest.fixture(scope="session")
def v3_warm_cache(v3_dir, tmp_path_factory):
    """A cold `graphs warmup` of the tiny V3 on the CPU: (cache_dir, manifest, progress output)."""
    cache_dir = tmp_path_factory.mktemp("graph_cache")
    out = io.StringIO()
    manifest = warmup(v3_dir, device="cpu", cache_dir=cache_dir, out=out, **STAGGERED, **SMALL_KEYS)
    return cache_dir, manifest, out.getvalue()
