"""vLLM's `bad_words`: words the output may not complete. Each word is read as token sequences: as the tokenizer
encodes it alone, and after a space (the form a word takes inside text) where that begins with another token and is
as long. A sequence's last token is banned at a step where the output so far ends with the tokens before it (a
one-token word is banned at every step). Only the output is matched, not the prompt."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from tpgraph.errors import RequestError


def encode_bad_words(tokenizer: Tokenizer | None, words: tuple[str, ...], vocab_size: int
                     ) -> tuple[tuple[int, ...], ...]:
    if not words:
        return ()
    if tokenizer is None:
        raise RequestError("bad_words need the engine's tokenizer")
    out: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
        if not alone:  # (a normalizer may drop what str.strip keeps: a zero-width space, a NUL)
            raise RequestError(f"bad_words entry {word!r} encodes to no tokens")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids)
        for ids in (alone, spaced) if spaced[:1] != alone[:1] and len(spaced) == len(alone) else (alone,):
            if any(t >= vocab_size for t in ids):  # (a tokenizer larger than the model's logits)
                raise RequestError(f"bad_words entry {word!r} encodes to ids past the vocabulary size {vocab_size}")
            if ids not in out:
                out.append(ids)
    return tuple(out)


def bad_word_bans(words: tuple[tuple[int, ...], ...], output_ids: Sequence[int]) -> set[int]:
    """The last tokens of the words that the output's end would complete next."""
    banned = set()
    n = len(output_ids)
    for ids in words:
        head = len(ids) - 1
        if head == 0 or (head <= n and all(output_ids[n - head + i] == t for i, t in enumerate(ids[:head]))):
            banned.add(ids[-1])
    return banned
