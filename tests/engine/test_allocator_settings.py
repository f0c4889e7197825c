"""model_runner.expandable_segments: a CUDA engine turns on the caching allocator's expandable segments
unless the user's allocator configuration says either way; a CPU engine leaves the allocator alone."""

from __future__ import annotations

import pytest
import torch

from encore.engine.model_runner import expandable_segments


@pytest.fixture
def settings(monkeypatch):
    """The settings handed to the allocator, recorded instead of applied; no configuration in the environment."""
    applied = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    return applied


def test_a_cuda_engine_turns_expandable_segments_on(settings):
    assert expandable_segments(torch.device("cpu")) is False
    assert settings == []
    assert expandable_segments(torch.device("cuda", 0)) is True
    assert settings == ["expandable_segments:True"]


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_choice_stands(settings, monkeypatch, var):
    monkeypatch.setenv(var, "expandable_segments:False")
    assert expandable_segments(torch.device("cuda", 0)) is False
    assert settings == []


def test_other_allocator_settings_leave_it_on(settings, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert expandable_segments(torch.device("cuda", 0)) is True
    assert settings == ["expandable_segments:True"]
