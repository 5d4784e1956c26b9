"""Tokenizers: a checkpoint's tokenizer.json, or the built-in byte-level one (built in code, no download)."""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from tpgraph.errors import CheckpointError

logger = logging.getLogger(__name__)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# a tokenizer's files other than tokenizer.json: sentencepiece's model, a byte-level BPE's vocabulary and merges
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt")


def _byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-to-printable-character map that the ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def unicode_to_byte() -> dict[str, int]:
    """The ByteLevel pre-tokenizer's characters back to the bytes they stand for."""
    return {ch: b for b, ch in _byte_to_unicode().items()}


def builtin_tokenizer() -> Tokenizer:
    """Token id == byte value for 0..255; 256 is BOS and 257 EOS (matches BUILTIN_MODEL)."""
    vocab = unicode_to_byte()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 256)])
    return tok


def load_tokenizer(model_dir: str | Path | None, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer.json; the byte tokenizer for the built-in model or a checkpoint without one."""
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            try:
                tok = Tokenizer.from_file(str(path))
            except Exception as exc:
                raise CheckpointError(f"cannot read {path}: {exc}") from None
            # a tokenizer.json saved after a call that truncated or padded (a training script's) keeps those settings,
            # which transformers turns off for each call that asks for none, as vLLM's prompts are encoded: kept, every
            # prompt was cut to their max_length, or padded with pad tokens
            tok.no_truncation()
            tok.no_padding()
            return tok
        # a tokenizer in files transformers reads but tpgraph does not (the byte tokenizer would encode garbage for it)
        slow = [name for name in SLOW_TOKENIZER_FILES if (Path(model_dir) / name).is_file()]
        if slow:
            raise CheckpointError(f"{model_dir} has a tokenizer in {' and '.join(slow)} but no tokenizer.json; write "
                                  f"one with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
        if vocab_size < 258:
            raise CheckpointError(f"{model_dir} has no tokenizer.json and its vocabulary ({vocab_size}) is too "
                                  "small for the built-in byte tokenizer")
        logger.warning("%s has no tokenizer.json: using the built-in byte-level tokenizer", model_dir)
    return builtin_tokenizer()
