"""encore-tiny: a 5.9M-parameter DeepSeek-V3 (MLA, MoE, MTP) trained on the Python stdlib by `train.py`."""
