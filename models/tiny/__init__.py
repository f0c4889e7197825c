"""encore-tiny: a 5.9M-parameter DeepSeek-V3 (MLA, MoE, MTP) trained on the Python stdlib by `train.py`."""

from pathlib import Path


def default_model_dir() -> Path:
    """The embedded encore-tiny checkpoint (DeepSeek-V3 architecture with an MTP layer)."""
    return Path(__file__).parent / "encore-tiny"
