"""encore.backends"""

BACKENDS = ("auto", "torch", "triton", "flashinfer")  # EngineConfig.attention_backend's values
