"""prompt_encoder: the tokenizer's own ``encode`` ids, through its Rust backend where that is the same encode."""

from __future__ import annotations

from pathlib import Path

import pytest

from encore.engine.tokenizer import load_tokenizer, prompt_encoder
from encore.models.tiny import default_model_dir

TEXTS = ["def fibonacci(n):", "The quick brown fox", "Ünïcödé — 日本語 🙂", "  leading and trailing  ", "a\n\tb\r\n",
         "<eos> and <bos> written out", "x" * 3000, "1234567890 + 0.5e-3"]


@pytest.mark.parametrize("which", ["encore-tiny", "v3 test checkpoint"])
def test_same_ids_as_the_tokenizers_encode(which, checkpoint):
    tokenizer = load_tokenizer(default_model_dir() if which == "encore-tiny" else Path(checkpoint("v3")))
    encode = prompt_encoder(tokenizer)
    assert encode != tokenizer.encode  # the backend itself
    for text in TEXTS:
        assert encode(text) == tokenizer.encode(text), text


def test_a_backend_set_to_truncate_is_left_to_encode():
    """transformers' encode turns a truncation set on the backend off for its call; the backend alone
    would truncate."""
    tokenizer = load_tokenizer(default_model_dir())
    tokenizer.backend_tokenizer.enable_truncation(4)
    encode = prompt_encoder(tokenizer)
    assert encode == tokenizer.encode
    assert len(encode("the quick brown fox jumps over the lazy dog")) > 4
