"""Byte-level BPE for encore-tiny, trained with HF `tokenizers` and saved for `AutoTokenizer`.

Byte-level means every string round-trips exactly (indentation, tabs, non-ASCII), which an engine's
incremental detokenizer tests rely on. `<|bos|>` is prepended by the tokenizer's post-processor, as
DeepSeek's tokenizer does, so a plain `tokenizer(prompt)` gives the model the context it was trained on.
"""

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """BPE over bytes with the GPT-2 split regex; `vocab_size` counts the special tokens and the 256 bytes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges (need > {len(alphabet) + 3})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def to_transformers(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """Wrap for `save_pretrained`: writes tokenizer.json and a tokenizer_config.json naming bos/eos/pad."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        # The default clean-up rewrites " ." to "." and would break exact round trips of source code.
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    to_transformers(tokenizer, model_max_length).save_pretrained(out_dir)
    # transformers 5 records its internal "TokenizersBackend"; the public alias also loads under transformers 4
    # (vLLM/SGLang images), and both resolve to the same class here.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
