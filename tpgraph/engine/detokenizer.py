"""Incremental detokenization with stop strings, for one sequence.

Text comes from tokenizers' DecodeStream (primed with the prompt's last tokens, so a leading space or a word joined
across the boundary decodes as in one pass), which never returns half a UTF-8 character: it holds back tokens whose
bytes do not decode yet (and real U+FFFD characters, which end its text as such bytes do: a long run of held tokens
is handed out up to a character not whole yet, _settle). When the sequence ends, those are decoded as they are
(U+FFFD for bytes that never completed a character), so the text holds every generated token, as decoding all of
them at once would. While a request has stop strings (and does not keep them in its output), a tail of the text
that a stop string starts with is held back, so text handed out never has to be taken back: the streamed text
always equals the final text.
"""

from __future__ import annotations

import sys

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.stop_strings import StopScanner

PRIME_TOKENS = 6  # prompt tokens the stream starts from
PRIME_LOOKBACK = 24  # prompt tokens from its end over which that window may slide back (past an invalid tail)
# held tokens past which those before a character not whole yet are handed out (_settle): real U+FFFD characters that a
# model writes hold the stream as a character's first bytes do, and were held all together, their run decoded again
# with every token (its square) and none of it streamed
HELD_LIMIT, UTF8_TAIL = 8, 3
_INVALID_PREFIX = "Invalid prefix encountered"  # (DecodeStream.step's error when earlier text changed)


def is_byte_fallback(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's decoder is, or holds, a byte-fallback one (read from its JSON: a while for a large
    vocabulary's, so worked out once per tokenizer by whoever holds it, not per detokenizer)."""
    decoder = tokenizer.decoder
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                 byte_fallback: bool | None = None) -> None:
        """byte_fallback: is_byte_fallback(tokenizer), given by a caller that makes many (None: worked out here)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        prime = self._prime(prompt_ids)
        self.stream = DecodeStream(ids=prime, skip_special_tokens=self.skip_special_tokens)
        self.decoded = prime  # the last tokens whose text is in self.text (or the prompt's)
        self.undecoded: list[int] = []  # tokens after them that the stream holds back (incomplete UTF-8 so far)
        # held tokens at which those before a character not whole yet are handed out; never with a byte-fallback
        # decoder, which reads a whole run of byte tokens as one (a stray byte makes every byte of its run U+FFFD, the
        # run's later characters too: no cut in it is final)
        if byte_fallback is None:
            byte_fallback = is_byte_fallback(tokenizer)
        self.held_limit = sys.maxsize if byte_fallback else HELD_LIMIT
        self.settle_at = self.held_limit
        # spaces_between_special_tokens False: an added token right after another is its own text alone, without the
        # space some decoders (WordPiece's) put before it (as vLLM's detokenizer gives it)
        self.added = {} if params.skip_special_tokens or params.spaces_between_special_tokens else {
            i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.last_added = False
        self.stops = StopScanner(params.stop) if params.stop else None
        self.stop_string: str | None = None  # the stop string that ended the sequence, once one has
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        # the output's text not handed out yet, after the `hold` characters before it that a stop string may begin in
        # (what was handed out before those is let go: keeping the whole text copied it all with every token)
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out

    def add(self, token_id: int, may_stop: bool = True) -> tuple[str, bool]:
        """Feed one generated token: (text to hand out now, whether a stop string ended the sequence). may_stop
        False (before min_tokens): no stop string ends it yet. A token that may stop looks only for stop strings
        ending in its own text (starting up to len(stop) - 1 characters before it, as vLLM's check does), so one
        completed before min_tokens stays in the text."""
        try:
            piece = self.stream.step(self.tokenizer, token_id) or ""
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # a byte-fallback decoder turned a whole invalid byte run into U+FFFD, a character the stream already
            # handed out included, so its text no longer starts with what it gave: the held tokens and this one
            # are cut as flush() cuts them, and a new stream starts after them (as vLLM recovers)
            piece = self._tail(self.undecoded + [token_id])
            self.stream = DecodeStream(ids=[token_id], skip_special_tokens=self.skip_special_tokens)
        if self.added:
            added = self.added.get(token_id)
            piece = added if added is not None and self.last_added else piece
            self.last_added = added is not None
        if not piece:
            self.undecoded.append(token_id)
            if len(self.undecoded) < self.settle_at:
                return "", False
            piece = self._settle()
            # (tried again at twice as many held tokens: a run with no place to cut costs its length, not its square)
            self.settle_at = self.held_limit if piece else 2 * len(self.undecoded)
            return self._hand_out(piece, may_stop) if piece else ("", False)
        if self.undecoded:
            self.decoded = (self.decoded + self.undecoded + [token_id])[-PRIME_TOKENS:]
            self.undecoded, self.settle_at = [], self.held_limit
        else:  # (the common case, a token that decodes at once: one list made, not three)
            self.decoded, self.settle_at = self.decoded[1 - PRIME_TOKENS:] + [token_id], self.held_limit
        if self.stops is None and not self.hold and not self.text:
            return piece, False  # no stop string to look for and nothing held back: the piece is all handed out
        return self._hand_out(piece, may_stop)

    def _hand_out(self, piece: str, may_stop: bool) -> tuple[str, bool]:
        """The text of the tokens decoded now added: what to hand out, and whether a stop string ended it."""
        if self._append(piece, may_stop):
            self.undecoded = []  # (tokens still held after a settled piece come after the stop: cut with the text)
            return self.flush(), True
        # (with the stop string kept in the output, a tail it may begin in is never taken back: vLLM holds none)
        held = self.stops.held if self.stops is not None and not self.include_stop else 0
        safe = len(self.text) - held
        if safe <= self.emitted:
            return "", False
        delta = self.text[self.emitted:safe]
        self.emitted = safe
        let_go = min(safe, len(self.text) - self.hold)
        if let_go > 0:
            self.text, self.emitted = self.text[let_go:], safe - let_go
        return delta, False

    def _settle(self) -> str:
        """The text of the held tokens up to the last place among the last few where they split no character (the
        two sides decode apart to what they decode to together, the later side to some text), which tokens after
        them no longer change; the stream starts again there and is fed the tokens after it. "" where there is none.
        (A character not whole yet has at most 3 bytes: its start is among the last 3 held tokens.)"""
        held = self.undecoded
        for cut in range(len(held) - 1, max(len(held) - UTF8_TAIL - 2, 0), -1):
            before, rest = self.decoded + held[:cut], held[cut:]
            head, tail = self._decode(before), self._decode(rest)
            if tail and head + tail == self._decode(before + rest):
                break
        else:
            return ""
        piece = self._tail(held[:cut])
        self.decoded, self.undecoded = before[-PRIME_TOKENS:], []
        # (primed as a prompt is: a window ending in U+FFFD would hand its text out again)
        self.stream = DecodeStream(ids=self._prime(self.decoded), skip_special_tokens=self.skip_special_tokens)
        for t in rest:
            more = self.stream.step(self.tokenizer, t) or ""
            if more:  # (none is expected: their text after the cut is what it was; taken as add takes it)
                piece += more
                self.decoded, self.undecoded = (self.decoded + self.undecoded + [t])[-PRIME_TOKENS:], []
            else:
                self.undecoded.append(t)
        return piece

    def _append(self, piece: str, may_stop: bool) -> bool:
        """Add text; whether a stop string ending in it cut the text there."""
        self.text += piece
        hit = self.stops.feed(piece, may_stop) if self.stops is not None else None
        if hit is None:
            return False
        back, stop = hit
        self.stop_string = stop
        at = len(self.text) - back
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        self.stops = None  # (nothing is added after a stop; a flush after it must not cut again)
        return True

    def _prime(self, prompt_ids: list[int]) -> list[int]:
        """The prompt tokens the stream starts from: the last PRIME_TOKENS, or the window of them that ends furthest on
        and decodes to text not ending in U+FFFD (within PRIME_LOOKBACK tokens of the prompt's end; else none).
        A prompt that ends inside a character (at most 3 bytes of it) would make the stream's first piece repeat the
        prompt's text, as would one ending in real U+FFFD characters (a stream whose prime ends in U+FFFD takes no
        prefix from it, and its first piece is then the whole prime's text): such tokens are left out, and the window
        slides back past them rather than shrink to nothing (a first token decoded with no prompt before it loses
        its leading space to a SentencePiece Strip decoder)."""
        for end in range(len(prompt_ids), max(len(prompt_ids) - PRIME_LOOKBACK, 0), -1):
            prime = self._from_a_whole_character(prompt_ids[max(end - PRIME_TOKENS, 0):end])
            if not self._decode(prime).endswith("\ufffd"):
                return prime
        return []

    def _from_a_whole_character(self, window: list[int]) -> list[int]:
        """A window that begins inside a character starts from the next one (a byte-fallback decoder turns a whole
        invalid run into U+FFFD, complete characters after it included); one token is always left (a skipped BOS
        before a prompt's partial character decodes to nothing: _prime then looks further back)."""
        while len(window) > 1 and self._decode(window).startswith("\ufffd"):
            window = window[1:]
        return window

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _tail(self, held: list[int]) -> str:
        """The text of `held`, the tokens after self.decoded: as the stream cuts its pieces; a byte-fallback decoder
        may turn the whole invalid run, complete characters before it included, into U+FFFD, and then only the held
        tokens' own text is theirs."""
        before, after = self._decode(self.decoded), self._decode(self.decoded + held)
        return after[len(before):] if after.startswith(before) else self._decode(held)

    def flush(self, may_stop: bool = True) -> str:
        """Everything not handed out yet, when the sequence ends: the held-back tail, and the text of the tokens whose
        bytes never completed a character (with U+FFFD for those bytes), which stop strings may still cut (then
        self.stop_string names the one that did). may_stop False (not past min_tokens): none is looked for."""
        if self.undecoded:
            tail = self._tail(self.undecoded)
            self.decoded, self.undecoded = (self.decoded + self.undecoded)[-PRIME_TOKENS:], []
            self._append(tail, may_stop)
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
