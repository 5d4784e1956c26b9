"""Incremental detokenization: streamed pieces add up to the final text, UTF-8 is never split, stop strings cut."""

import pytest

from tpgraph.engine.detokenizer import Detokenizer
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.tokenizer import builtin_tokenizer

TOK = builtin_tokenizer()
PROMPT = TOK.encode("Q:").ids


def stream(text, **params):
    detok = Detokenizer(TOK, PROMPT, SamplingParams(**params))
    pieces, stopped = [], False
    for t in TOK.encode(text, add_special_tokens=False).ids:
        piece, stopped = detok.add(t)
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(detok.flush())
    return pieces, stopped


def test_pieces_add_up_and_never_split_a_character():
    text = " héllo 你好, wörld 🚀!"
    pieces, stopped = stream(text)
    assert "".join(pieces) == text and not stopped
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the first bytes of a multi-byte character wait for the rest
    assert pieces[0] == " "  # primed with the prompt: a leading space survives


@pytest.mark.parametrize("stop,include,expected", [
    (["wör"], False, " héllo 你好, "),
    (["wör"], True, " héllo 你好, wör"),
    (["你好", "llo"], False, " hé"),  # the earliest stop wins
    (["🚀"], False, " héllo 你好, wörld "),
    (["absent"], False, None),
])
def test_stop_strings(stop, include, expected):
    text = " héllo 你好, wörld 🚀!"
    pieces, stopped = stream(text, stop=stop, include_stop_str_in_output=include)
    assert stopped == (expected is not None)
    assert "".join(pieces) == (expected if expected is not None else text)


def test_text_that_could_start_a_stop_string_is_held_back():
    detok = Detokenizer(TOK, PROMPT, SamplingParams(stop=["END"]))
    out = [detok.add(t)[0] for t in TOK.encode("abEN", add_special_tokens=False).ids]
    assert "".join(out) == "ab"  # "EN" might become "END"
    assert detok.add(TOK.encode("X", add_special_tokens=False).ids[0]) == ("ENX", False)  # it did not
    assert detok.flush() == ""


def test_with_the_stop_string_in_the_output_nothing_is_held_back():
    """include_stop_str_in_output: text a stop string may begin in is never taken back (the string stays), so vLLM
    holds none back (its stop_buffer_length is 0) and hands out "EN" at once; the stop cuts after the string."""
    detok = Detokenizer(TOK, PROMPT, SamplingParams(stop=["END"], include_stop_str_in_output=True))
    assert [detok.add(t)[0] for t in TOK.encode("abEN", add_special_tokens=False).ids] == ["a", "b", "E", "N"]
    assert detok.add(TOK.encode("D", add_special_tokens=False).ids[0]) == ("D", True) and detok.flush() == ""


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("tail", [[0xFD], [0xFD, 0xFD, 0xFD], [0xE4, 0xBD]])  # bytes that never complete a character
def test_bytes_that_never_decode_are_flushed_at_the_end(tail):
    ids = _ids(" ok ") + tail
    detok = Detokenizer(TOK, PROMPT, SamplingParams())
    pieces = [detok.add(t)[0] for t in ids]
    assert "".join(pieces) == " ok "  # held back while they might still complete a character
    pieces.append(detok.flush())
    assert "".join(pieces) == TOK.decode(ids) and pieces[-1].count("\ufffd") == len(TOK.decode(tail))
    assert detok.flush() == ""


def test_bytes_held_back_then_a_character_completes_them_on_the_way():
    ids = [0xFD] + _ids("x") + [0xE4, 0xBD, 0xA0]  # an invalid byte, then a valid 3-byte character
    detok = Detokenizer(TOK, PROMPT, SamplingParams())
    text = "".join(detok.add(t)[0] for t in ids) + detok.flush()
    assert text == TOK.decode(ids) == "\ufffdx你"


def test_a_stop_string_in_the_flushed_tail_still_cuts_it():
    detok = Detokenizer(TOK, PROMPT, SamplingParams(stop=["\ufffd"]))
    assert [detok.add(t) for t in _ids("ab") + [0xFD]] == [("a", False), ("b", False), ("", False)]
    assert detok.flush() == ""


def test_the_text_kept_is_what_is_not_handed_out_and_what_a_stop_string_may_begin_in():
    """A long output's text is not kept whole (appending to it copied all of it with every token): only what a stop
    string may still begin in stays; a stop string across pieces is still found."""
    detok = Detokenizer(TOK, PROMPT, SamplingParams(stop=["xyz"]))
    out = "".join(detok.add(t)[0] for t in _ids("ab" * 500 + "xy"))
    assert out == "ab" * 500 and len(detok.text) <= 4
    assert detok.add(_ids("z")[0]) == ("", True) and detok.flush() == ""
    plain = Detokenizer(TOK, PROMPT, SamplingParams())
    assert "".join(plain.add(t)[0] for t in _ids("cd" * 500)) == "cd" * 500 and plain.text == ""


def byte_fallback_tokenizer(words: list[str], strip: bool = False):
    """A Llama 2 / Mistral-style tokenizer: <unk>, the 256 <0xNN> byte tokens (ids 1-256), then `words`; its decoder
    turns "▁" into spaces and fuses bytes (ByteFallback), and with `strip` drops one leading space as theirs do.
    Returns it and its vocabulary."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(["<unk>", *(f"<0x{b:02X}>" for b in range(256)), *words])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip else []))
    return tok, vocab


@pytest.mark.parametrize("stop, expected", [(["bc", "abcd"], " thea"), (["cd", "abcd"], " theab"),
                                            (["abcd", "bc"], " the")])
def test_one_token_completing_two_stop_strings_stops_at_the_first_listed(stop, expected):
    """vLLM's check_stop_strings: the first string in the stop list found in the token's text, wherever others end."""
    tok, vocab = byte_fallback_tokenizer(["▁the", "abcd"])
    detok = Detokenizer(tok, [vocab["▁the"]], SamplingParams(stop=stop))
    pieces = [detok.add(t) for t in (vocab["▁the"], vocab["abcd"])]
    assert "".join(p for p, _ in pieces) == expected and pieces[-1][1] and detok.stop_string == stop[0]


def test_a_byte_fallback_tokenizer_flushes_only_the_held_bytes():
    """Llama 2 / Mistral decoders (ByteFallback) turn a whole invalid byte run into U+FFFD, a character already
    handed out included: the tail is then the held tokens' own decode, one U+FFFD, not the difference of decodes."""
    tok, _ = byte_fallback_tokenizer(["▁the"])
    ids = [257, 1 + 0xE4, 1 + 0xBD, 1 + 0xA0, 1 + 0xE5]  # " the", 你 in three bytes, then a byte that never completes
    detok = Detokenizer(tok, [257], SamplingParams())
    text = "".join(detok.add(t)[0] for t in ids)
    assert text == " the你"
    assert detok.flush() == "\ufffd"


def test_a_prompt_that_ends_inside_a_character_adds_none_of_its_text():
    """Prompt bytes "A", 0xC3 (the first of a two-byte character) and output bytes 0x80 ...: the stream, primed with
    the whole prompt tail, handed out "AÀ..." (the prompt's "A" again). The output's text is its own bytes'."""
    d = Detokenizer(TOK, [256, 65, 0xC3], SamplingParams())
    text = "".join(d.add(t)[0] for t in [0x80, 0x80, 104, 105]) + d.flush()
    assert "A" not in text and text.endswith("hi") and text == TOK.decode([0x80, 0x80, 104, 105])


@pytest.mark.parametrize("prompt", [[256, 0xE4, 0xBD], [0xE4, 0xBD], [0xE4]])
@pytest.mark.parametrize("output", [[104, 105], [0x80, 0x80, 104, 105]])
def test_a_prompt_that_is_only_a_partial_character_adds_none_of_its_bytes(prompt, output):
    """A prompt window that is a partial character alone (after a BOS that skip_special_tokens decodes to nothing):
    the first loop left its last token and the second would not pop it, so its bytes reached the output's text
    ("\ufffdhi" for "hi", or a character made of the prompt's byte and the output's)."""
    d = Detokenizer(TOK, prompt, SamplingParams())
    assert "".join(d.add(t)[0] for t in output) + d.flush() == TOK.decode(output)


@pytest.mark.parametrize("skip", [True, False])
def test_a_prompt_ending_in_more_invalid_bytes_than_a_partial_character_adds_none_of_its_text(skip):
    """Stray bytes, then a partial character: the window still ended in U+FFFD after 3 tokens were dropped, and a
    stream primed so takes no prefix from it: its first piece held the prompt's text ("a\ufffd\ufffdhi")."""
    d = Detokenizer(TOK, [256, 97, 0x80, 0x80, 0x80, 0xE4, 0xBD], SamplingParams(skip_special_tokens=skip))
    assert "".join(d.add(t)[0] for t in _ids(" hi")) + d.flush() == " hi"


def test_a_byte_fallback_window_that_begins_inside_a_character_keeps_the_leading_space():
    """A SentencePiece-style tokenizer (byte-fallback <0x..> tokens, "▁" for spaces, a Strip decoder): a prompt
    window that starts in the middle of an emoji's bytes decoded to U+FFFD, complete characters after it included,
    and priming popped every token; the first output token then lost its leading space."""
    tok, vocab = byte_fallback_tokenizer(["▁Sure", "▁the", "Hi"], strip=True)
    rocket = [vocab[f"<0x{b:02X}>"] for b in "🚀".encode()]
    d = Detokenizer(tok, [vocab["Hi"], *rocket, *rocket], SamplingParams())
    text = "".join(d.add(t)[0] for t in [vocab["▁Sure"], vocab["▁the"]]) + d.flush()
    assert text == " Sure the"


@pytest.mark.parametrize("strip", [False, True])
def test_a_byte_fallback_run_broken_after_a_character_was_handed_out_does_not_fail(strip):
    """你 in three byte tokens, then a stray byte, then a word: ByteFallback decodes the four bytes together, all
    U+FFFD, so the text no longer starts with the 你 already handed out and DecodeStream.step raised "Invalid prefix"
    (the engine's step failed). The stray byte is U+FFFD, the text after it goes on."""
    tok, vocab = byte_fallback_tokenizer(["▁the"], strip=strip)
    ids = [vocab["▁the"], 1 + 0xE4, 1 + 0xBD, 1 + 0xA0, 1 + 0xE5, vocab["▁the"], vocab["▁the"]]
    detok = Detokenizer(tok, [vocab["▁the"]], SamplingParams())
    text = "".join(detok.add(t)[0] for t in ids) + detok.flush()
    assert text == " the你\ufffd the the"


def wordpiece_tokenizer():
    """A decoder that puts a space before every token but "##" pieces (WordPiece's): special tokens too."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[A]", "[B]"])
    return tok


@pytest.mark.parametrize("spaces, expected", [(True, "hi [A] [B] there"), (False, "hi [A][B] there")])
def test_spaces_between_special_tokens(spaces, expected):
    """vLLM's spaces_between_special_tokens (a TypeError here): False puts no space between two special tokens kept
    in the text, as vLLM's detokenizer gives an added token right after another as its own text alone."""
    tok = wordpiece_tokenizer()
    ids = [1, tok.token_to_id("[A]"), tok.token_to_id("[B]"), 2]
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    detok = Detokenizer(tok, [2], params)
    assert "".join(detok.add(t)[0] for t in ids) + detok.flush() == " " + expected
    skipped = Detokenizer(tok, [2], SamplingParams(spaces_between_special_tokens=spaces))  # (nothing between then)
    assert "".join(skipped.add(t)[0] for t in ids) + skipped.flush() == " hi there"


def test_a_prompt_ending_in_real_replacement_characters_still_primes_the_stream():
    """A SentencePiece-style prompt "Hi" and two U+FFFD characters (complete, each three byte tokens): every token of
    the 6-token window decodes to U+FFFD, so priming popped them all and the first output token, decoded alone, lost
    its leading space to the Strip decoder. The window now slides back to the prompt's last tokens that decode
    cleanly (the replacement characters, the prompt's own text, still add none of it)."""
    tok, vocab = byte_fallback_tokenizer(["▁Sure", "▁the", "Hi"], strip=True)
    fffd = [vocab[f"<0x{b:02X}>"] for b in "\ufffd".encode()]
    d = Detokenizer(tok, [vocab["Hi"], *fffd, *fffd], SamplingParams())
    text = "".join(d.add(t)[0] for t in [vocab["▁Sure"], vocab["▁the"]]) + d.flush()
    assert text == " Sure the"


@pytest.mark.parametrize("after", ["b", "你", "🚀 ok", "\ufffd"])
def test_a_run_of_real_replacement_characters_streams_and_costs_each_token_little(after):
    """A model writing U+FFFD characters (mojibake in its training text): each one's text ends in U+FFFD, as a
    character's first bytes do, so the stream held them all, handed out nothing until the run ended and decoded the
    whole run again with every token (its square: 600 us a token at 4000 of them). What is before a character not
    whole yet is handed out now; a character after the run still completes."""
    ids = list("\ufffd".encode()) * 300 + _ids(after)
    detok = Detokenizer(TOK, PROMPT, SamplingParams())
    pieces, held = [], 0
    for t in ids:
        pieces.append(detok.add(t)[0])
        held = max(held, len(detok.undecoded))
    pieces.append(detok.flush())
    assert "".join(pieces) == TOK.decode(ids) == "\ufffd" * 300 + after
    assert held <= 8 and len("".join(pieces[:600])) >= 190  # (streamed as it came, a bounded run held)


def test_a_stop_string_across_settled_replacement_characters_cuts_there():
    """A stop string found in a settled piece ends the sequence; the tokens still held after it add nothing."""
    ids = [0x80, 0x80, 0x80] + list("\ufffd".encode()) * 2 + [0xE4, 0xBD, 0xA0]
    detok = Detokenizer(TOK, PROMPT, SamplingParams(stop=["\ufffd\ufffd\ufffd\ufffd"]))
    out, stopped = "", False
    for t in ids:
        piece, stopped = detok.add(t)
        out += piece
        if stopped:
            break
    assert stopped and out + (detok.flush() if not stopped else "") == "" and detok.stop_string is not None


def test_a_byte_fallback_run_is_not_cut_early():
    """A byte-fallback decoder reads a whole run of byte tokens as one (a stray byte makes the run's later
    characters U+FFFD too): a long held run is not cut, so the text is still what decoding it whole gives."""
    tok, vocab = byte_fallback_tokenizer(["▁the"])
    ids = [1 + 0xFD, *(1 + b for b in "\ufffd".encode() * 4), *(1 + b for b in "你".encode())]
    detok = Detokenizer(tok, [vocab["▁the"]], SamplingParams())
    assert "".join(detok.add(t)[0] for t in ids) + detok.flush() == tok.decode(ids)


def test_without_stop_strings_each_piece_is_handed_out_at_once_and_the_window_follows_the_tokens():
    # (the no-stop-string path hands a decoded piece straight out: it must match the held-back path's text, token
    # by token, and keep the last PRIME_TOKENS decoded ids a restarted stream is primed with)
    text = "ab héllo 你好 🚀 xyz, wörld and more plain ascii"
    ids = TOK.encode(text, add_special_tokens=False).ids
    plain = Detokenizer(TOK, PROMPT, SamplingParams())
    held = Detokenizer(TOK, PROMPT, SamplingParams(stop=["\x00never"]))  # (holds nothing back in this text)
    for i, t in enumerate(ids):
        assert plain.add(t) == held.add(t)
        if not plain.undecoded:
            assert plain.decoded == (PROMPT + ids[:i + 1])[-6:] == held.decoded
    assert plain.flush() == held.flush() == ""
    again = Detokenizer(TOK, PROMPT, SamplingParams())
    assert "".join(again.add(t)[0] for t in ids) == text
