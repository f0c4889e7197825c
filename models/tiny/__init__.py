"""encore-tiny: a ~9M-parameter DeepSeek-V3 (MLA + MoE + MTP) trained on the Python stdlib, rebuilt by `train.py`."""
