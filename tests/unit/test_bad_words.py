"""vLLM's allowed_token_ids and bad_words: checked in SamplingParams, the request limits and the protocol; words read
as token sequences as vLLM reads them; applied on every sampling path (greedy, the torch chain, the fused draw
under TRITON_INTERPRET=1); and in the engine, where a word's bans read the output's last tokens, the step in flight
included."""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from tpgraph import SamplingParams, TPEngine
from tpgraph.engine.bad_words import bad_word_bans, encode_bad_words
from tpgraph.engine.limits import RequestLimits
from tpgraph.engine.sampler import Sampler, SampleRow, plain_greedy
from tpgraph.errors import RequestError
from tpgraph.server.protocol import CompletionRequest


class WordTokenizer:
    """Words as a tokenizer with a space marker encodes them: "Ġ" + a word after a space is one token where the
    vocabulary has it, else characters."""

    VOCAB = {"bad": 1, "Ġbad": 2, "word": 3, "Ġword": 4, "s": 5, "Ġ": 6, "x": 7, "y": 8}

    def encode(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        ids = []
        for i, word in enumerate(text.split(" ")):
            if i and ("Ġ" + word) in self.VOCAB:
                ids.append(self.VOCAB["Ġ" + word])
                continue
            if i:
                ids.append(self.VOCAB["Ġ"])
            ids += [self.VOCAB[word]] if word in self.VOCAB else [self.VOCAB[c] for c in word]
        return SimpleNamespace(ids=ids)


def test_a_word_is_banned_alone_and_after_a_space_where_that_is_another_token():
    tok = WordTokenizer()
    assert encode_bad_words(tok, ("bad",), 10) == ((1,), (2,))
    assert encode_bad_words(tok, ("bad word",), 10) == ((1, 4), (2, 4))
    assert encode_bad_words(tok, (" xy",), 10) == ((7, 8),)  # (" xy" is longer: the spaced form is not kept)
    assert encode_bad_words(tok, ("bad", "bad"), 10) == ((1,), (2,))
    assert encode_bad_words(tok, (), 10) == ()
    with pytest.raises(RequestError, match="past the vocabulary size 4"):
        encode_bad_words(tok, ("word",), 4)
    with pytest.raises(RequestError, match="need the engine's tokenizer"):
        encode_bad_words(None, ("bad",), 10)


def test_a_words_last_token_is_banned_where_the_output_ends_with_the_rest():
    words = ((1,), (3, 4), (5, 6, 7))
    assert bad_word_bans(words, []) == {1}
    assert bad_word_bans(words, [9, 3]) == {1, 4}
    assert bad_word_bans(words, [3, 9]) == {1}
    assert bad_word_bans(words, [5, 6]) == {1, 7}
    assert bad_word_bans(words, [6]) == {1}


@pytest.mark.parametrize(("kw", "needle"), [
    ({"allowed_token_ids": []}, "allowed_token_ids is empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids entry must be >= 0"),
    ({"allowed_token_ids": 5}, "allowed_token_ids must be a list of token ids"),
    ({"bad_words": [" "]}, "bad_words must hold words"),
    ({"bad_words": [3]}, "bad_words must hold words"),
    ({"bad_words": ["w"] * 101}, "at most 100"),
])
def test_bad_fields_are_refused_with_the_reason(kw, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**kw)


def test_fields_are_normalized_and_ids_past_the_vocabulary_refused():
    assert SamplingParams(allowed_token_ids=[5, 2, 5]).allowed_token_ids == (2, 5)
    assert SamplingParams(bad_words="no").bad_words == ("no",)
    limits = RequestLimits(vocab_size=100, max_model_len=64, cache_tokens=1000)
    with pytest.raises(RequestError, match=r"allowed_token_ids must be below the vocabulary size 100, got \[100\]"):
        limits.check([1], SamplingParams(allowed_token_ids=[3, 100]))
    body = CompletionRequest(model="m", prompt="p", allowed_token_ids=[4, 3], bad_words=["x"])
    params = body.sampling_params(4, None)
    assert params.allowed_token_ids == (3, 4) and params.bad_words == ("x",)
    with pytest.raises(ValueError, match="token ids must be integers"):
        CompletionRequest(model="m", prompt="p", allowed_token_ids=[True])


@pytest.mark.parametrize("path", ["greedy", "torch", "fused"])
def test_only_allowed_ids_are_drawn_and_banned_ones_never(path, monkeypatch):
    if path == "fused":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the fused draw runs on CPU under TRITON_INTERPRET=1")
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    t = 0.0 if path == "greedy" else 1.0
    rows = [SampleRow(SamplingParams(temperature=t, allowed_token_ids=[3, 17, 30]), [1], []) for _ in range(3)]
    rows += [SampleRow(SamplingParams(temperature=t), [1], [], banned_ids=tuple(range(0, 40, 2))) for _ in range(3)]
    assert not any(plain_greedy([r]) for r in rows[:3])
    sampler = Sampler("cpu", seed=3, fused=path == "fused")
    for _ in range(5):
        ids = sampler.sample(logits, rows).token_ids
        assert all(i in (3, 17, 30) for i in ids[:3]) and all(i % 2 for i in ids[3:])
    if path == "greedy":
        assert ids[0] == max((3, 17, 30), key=lambda i: logits[0, i])
    assert torch.equal(logits, before)


@pytest.fixture(scope="module")
def engine():
    with TPEngine(device="cpu", max_model_len=128, max_num_seqs=8, block_size=8) as e:
        yield e


def test_the_engine_never_completes_a_bad_word(engine):
    """The bias makes greedy decoding write "a" over and over, "b" its second choice: with "aa" a bad word, each "a"
    must be followed by "b", a ban that reads the token before it (the step in flight, under overlap)."""
    (a,), (b,) = (engine.tokenizer.encode(c, add_special_tokens=False).ids for c in "ab")
    forced = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logit_bias={a: 100, b: 99})
    assert engine.generate(["x", "y"], forced)[0].outputs[0].token_ids == [a] * 9
    banned = dataclasses.replace(forced, bad_words=("aa",))
    for out in engine.generate(["x", "y"], banned):
        assert out.outputs[0].token_ids == [a, b] * 4 + [a]
    one_token = dataclasses.replace(forced, bad_words=("a",))  # (a one-token word: banned at every step)
    assert engine.generate("x", one_token)[0].outputs[0].token_ids == [b] * 9


def test_the_engine_samples_only_allowed_ids_on_every_rank_alike(engine):
    allowed = (65, 66, 67)
    outs = engine.generate(["a", "b"], SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                                                      allowed_token_ids=allowed, logprobs=1))
    for out in outs:
        assert set(out.outputs[0].token_ids) <= set(allowed)
