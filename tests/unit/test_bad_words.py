"""vLLM's allowed_token_ids and bad_words: checked in SamplingParams, the request limits and the protocol; words read
as token sequences as vLLM reads them; applied on every sampling path (greedy, the torch chain, the fused draw
under TRITON_INTERPRET=1); and in the engine, where a word's bans read the output's last tokens, the step in flight
included."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from tokenizers import normalizers
from tpgtest.markers import interpreted

import tpgraph.engine.sampler as sampler_module
from tpgraph import SamplingParams, TPEngine
from tpgraph.engine.bad_words import bad_word_bans, encode_bad_words
from tpgraph.engine.limits import RequestLimits
from tpgraph.engine.penalties import PenaltyTable
from tpgraph.engine.sampler import Sampler, SampleRow, plain_greedy, worst_case_rows
from tpgraph.engine.sequence import Sequence
from tpgraph.errors import RequestError
from tpgraph.server.protocol import CompletionRequest
from tpgraph.tokenizer import builtin_tokenizer


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
    ({"bad_words": [f"w{i}" for i in range(101)]}, "at most 100"),
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


@pytest.mark.parametrize("path", ["greedy", "torch", pytest.param("fused", marks=interpreted)])
def test_only_allowed_ids_are_drawn_and_banned_ones_never(path):
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


@pytest.mark.parametrize("path", ["greedy", "torch", pytest.param("fused", marks=interpreted)])
def test_fixed_ban_lists_draw_what_the_same_ids_banned_each_step_draw(path):
    """A row's fixed ban lists (uploaded once, kept) mask exactly what the same ids given as the step's banned_ids
    mask: the same tokens and log-probabilities, step after step, and none of them ever drawn."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.0 if path == "greedy" else 1.0, logprobs=3)
    lists = [(tuple(range(0, 40, 2)), (1, 3, 5)), (tuple(range(0, 40, 2)), (1, 3, 5)), ((7, 9),), ((7, 9),), (), ()]
    per_step = [(), (11, 13), (), (9, 21), (4,), ()]
    fixed = [SampleRow(params, [1], [], banned_ids=b, fixed_banned=f) for f, b in zip(lists, per_step, strict=True)]
    given = [SampleRow(params, [1], [], banned_ids=tuple(sorted({*b, *(t for ids in f for t in ids)})))
             for f, b in zip(lists, per_step, strict=True)]
    kept, listed = Sampler("cpu", seed=3, fused=path == "fused"), Sampler("cpu", seed=3, fused=path == "fused")
    for _ in range(3):
        a, b = kept.sample(logits, fixed), listed.sample(logits, given)
        assert (a.token_ids, a.logprobs, a.top_ids) == (b.token_ids, b.logprobs, b.top_ids)
        assert all(t not in r.banned_ids for t, r in zip(a.token_ids, given, strict=True))


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


def test_the_engine_samples_only_allowed_ids(engine):
    """(TP=2 with allowed ids: multirank/test_engine_tp.py)"""
    allowed = (65, 66, 67)
    outs = engine.generate(["a", "b"], SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                                                      allowed_token_ids=allowed))
    for out in outs:
        assert set(out.outputs[0].token_ids) <= set(allowed)


def test_a_step_whose_every_allowed_id_is_banned_ends_the_sample_rather_than_draw_a_banned_one(engine):
    """allowed {a, b} with bad words "aa" and "ab": after an "a" every allowed id is banned, so the row's every
    logit is masked and the draw takes id 0, which the request does not allow (helper-107). The sample ends there
    ("abort", as a grammar's refusal ends one) with only allowed tokens in it."""
    (a,), (b,) = (engine.tokenizer.encode(c, add_special_tokens=False).ids for c in "ab")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={a: 100},
                            allowed_token_ids=(a, b), bad_words=("aa", "ab"))
    for out in engine.generate(["x", "y"], params):
        assert out.outputs[0].token_ids == [a] and out.outputs[0].finish_reason == "abort"
    # with one left unbanned the sample goes on
    out = engine.generate("x", dataclasses.replace(params, bad_words=("aa",)))[0].outputs[0]
    assert out.token_ids == [a, b] * 3 and out.finish_reason == "length"


def test_a_sample_ended_for_a_banned_token_keeps_the_text_of_the_tokens_it_keeps(engine):
    """The sample ends 'abort' at the banned token but keeps the tokens before it: their text must be there too.
    Text the detokenizer held back (here "a", which the stop string "az" may begin) was dropped, not flushed as
    every other end of a sample flushes it: token_ids [a] with text ''."""
    (a,), (b,) = (engine.tokenizer.encode(c, add_special_tokens=False).ids for c in "ab")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={a: 100},
                            allowed_token_ids=(a, b), bad_words=("aa", "ab"), stop=["az"])
    for out in engine.generate(["x", "y"], params):
        assert out.outputs[0].token_ids == [a] and out.outputs[0].finish_reason == "abort"
        assert out.outputs[0].text == "a"


def test_a_stop_id_drawn_where_min_tokens_and_bad_words_ban_every_allowed_id_does_not_end_the_sample_early(engine):
    """allowed {0, a, b}, 0 a stop id that min_tokens 4 holds back, bad words "aa" and "ab": after an "a" the row
    bans every allowed id and the draw takes id 0, a stop id its row banned. The ban check read allowed ids and bad
    words but not min_tokens' held stop ids, so the sample ended "stop" after 2 tokens, under min_tokens; it ends
    'abort' there, as for any other banned token."""
    (a,), (b,) = (engine.tokenizer.encode(c, add_special_tokens=False).ids for c in "ab")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={a: 100},
                            allowed_token_ids=(0, a, b), stop_token_ids=(0,), min_tokens=4, bad_words=("aa", "ab"))
    for out in engine.generate(["x", "y"], params):
        assert out.outputs[0].token_ids == [a] and out.outputs[0].finish_reason == "abort"


# what review found (helper-87): each case failed before its mend

def _dropping_tokenizer():
    """A tokenizer.json whose normalizer drops some characters (BERT's clean_text: control and zero-width ones), as
    Python's str.strip() does not: a non-blank word that encodes to no tokens at all."""
    tok = builtin_tokenizer()
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=False, strip_accents=False,
                                                lowercase=False)
    return tok


def test_a_bad_word_that_encodes_to_no_tokens_is_refused():
    """encode_bad_words keeps () for such a word; bad_word_bans then raises IndexError (ids[-1]) inside the step."""
    with pytest.raises(RequestError):
        encode_bad_words(_dropping_tokenizer(), ("\u200b",), 258)


def test_a_bad_word_that_encodes_to_no_tokens_does_not_kill_the_engine():
    with TPEngine(device="cpu", max_model_len=64, max_num_seqs=2, block_size=8) as engine:
        engine.tokenizer.normalizer = _dropping_tokenizer().normalizer  # (the core reads the same tokenizer)
        with pytest.raises(RequestError):  # today: IndexError from the step (a server's engine loop fails for good)
            engine.generate("x", SamplingParams(max_tokens=3, bad_words=["\x00"]))
        assert len(engine.generate("x", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_a_huge_bad_word_is_refused_before_the_engine_thread_tokenizes_it():
    """A bad word is tokenized on every rank's step thread (rank 0's _collect, each follower's _apply), holding the
    GIL: a 4M-character word took ~6 s there, while every request waited. Its length is refused where the request is
    built, before any engine sees it."""
    SamplingParams(bad_words=["ab" * 500])
    with pytest.raises(RequestError, match="at most 1000 characters"):
        SamplingParams(max_tokens=4, bad_words=["ab" * 2_000_000])


def test_the_memory_profiles_rows_take_the_allowed_ids_mask(monkeypatch):
    """worst_case_rows must take every stage that makes [rows, vocab] temporaries (test_sampler.py says so):
    keep_allowed makes three (a bool mask, its inverse and the masked copy)."""
    ran = []
    keep_allowed = sampler_module.keep_allowed
    monkeypatch.setattr(sampler_module, "keep_allowed", lambda *a: ran.append(1) or keep_allowed(*a))
    rows = worst_case_rows(3, 100, 300)
    Sampler("cpu", penalties=PenaltyTable(3, 100, "cpu")).sample(torch.randn(3, 100), rows)
    assert ran


def test_rows_without_bad_words_pay_nothing_for_them_each_step(monkeypatch):
    """Every step builds every row and asks each sequence whether its bans read its output: a plain request's row
    looks for no bad word, and the answer is a field set once (a property that scanned the words cost ~60 us a step at
    256 rows)."""
    import tpgraph.engine.core as core_module

    looked = []
    bans = core_module.bad_word_bans
    monkeypatch.setattr(core_module, "bad_word_bans", lambda *a: looked.append(1) or bans(*a))
    with TPEngine(device="cpu", max_model_len=64, max_num_seqs=4, block_size=8) as engine:
        engine.generate(["a", "b"], SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True))
        assert looked == []
        engine.generate("a", SamplingParams(temperature=0.8, seed=1, max_tokens=8, bad_words=["zz"]))
        assert looked
    assert not Sequence(0, [1], 4).reads_output and Sequence(0, [1], 4, bad_words=((1, 2),)).reads_output


def count_uploads(monkeypatch) -> list[int]:
    """The sampler's uploads from now on, each as the ids it carried (appended to the list returned)."""
    uploaded: list[int] = []
    upload_parts, upload = sampler_module.to_device_parts, sampler_module.to_device
    monkeypatch.setattr(sampler_module, "to_device_parts", lambda parts, *a, **k: uploaded.append(
        sum(len(p) for p in parts)) or upload_parts(parts, *a, **k))
    monkeypatch.setattr(sampler_module, "to_device",
                        lambda values, *a, **k: uploaded.append(len(values)) or upload(values, *a, **k))
    return uploaded


def test_allowed_token_ids_are_not_rebuilt_and_uploaded_every_step(monkeypatch):
    """keep_allowed builds Python lists of every allowed id of every row and uploads them each step: 8 rows allowing
    60k ids cost ~12 ms of host time a step in list building alone (more than a whole 8B decode step on an H200),
    for the whole batch. vLLM builds a request's mask once, when it joins the batch. A request's allowed ids should
    reach the device once, not every step."""
    uploaded = count_uploads(monkeypatch)
    allowed = tuple(range(20, 220))
    with TPEngine(device="cpu", max_model_len=64, max_num_seqs=4, block_size=8) as engine:
        out = engine.generate("a", SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True,
                                                  allowed_token_ids=allowed))
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    assert sum(uploaded) < 3 * len(allowed), f"{len(uploaded)} uploads of {sum(uploaded)} ids for 20 tokens"


def test_one_token_bad_words_and_min_tokens_stop_ids_are_uploaded_once_not_every_step(monkeypatch):
    """A request's one-token bad words (banned at every step) and, before min_tokens, its stop ids and EOS were listed
    into the step's banned ids and uploaded again each step, as the allowed ids were: they are fixed for the request
    (for each side of min_tokens), so they reach the device once. Only the bans of words of several tokens, which
    read the output's last tokens, change from step to step."""
    uploaded = count_uploads(monkeypatch)
    letters, stops = "cdefghijklmnopqrstuvwxyz", list(range(130, 250))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=24, min_tokens=12, ignore_eos=True,
                            bad_words=list(letters) + ["ab"], stop_token_ids=stops)
    with TPEngine(device="cpu", max_model_len=64, max_num_seqs=4, block_size=8) as engine:
        out = engine.generate("a", params)[0].outputs[0].token_ids
        banned = {ord(c) for c in letters}
    assert len(out) >= 12 and not set(out) & banned and not set(out[:11]) & set(stops)
    assert all((x, y) != (ord("a"), ord("b")) for x, y in zip(out, out[1:], strict=False))
    fixed = len(banned) + len(stops) + 1 + len(banned)  # (both sides of min_tokens, once each)
    assert sum(uploaded) < fixed + 8 * len(out), f"{len(uploaded)} uploads of {sum(uploaded)} ids for {len(out)} tokens"


def test_the_kept_uploads_of_finished_requests_are_bounded_in_memory_not_only_in_entries(monkeypatch):
    """Each request's allowed_token_ids (and logit_bias) stays cached on the device after its request ends, until the
    cache holds MAX_ENTRIES entries: a server whose requests each allow a few ids kept millions of tiny device tensors
    (CUDA's allocator gives each at least 512 bytes: ~2 GiB beside a KV cache sized to fill the GPU). What the cache
    holds on the device, each tensor taken at that least, stays within MAX_ENTRIES entries' bytes."""
    monkeypatch.setattr(sampler_module.KeptUploads, "MAX_ENTRIES", 4096)
    for uploads, value in ((sampler_module.allowed_ids_uploads(torch.device("cpu")), lambda i: (i,)),
                           (sampler_module.logit_bias_uploads(torch.device("cpu")), lambda i: ((i, 0.5),))):
        for i in range(2000):  # (one request after another, each its own tuple of one entry)
            assert uploads.get(value(i))[0].tolist() == [i]
        held = sum(max(t.numel() * t.element_size(), 512) for _, tensors in uploads._cache.values() for t in tensors)
        assert held <= 4096 * 8, f"{len(uploads._cache)} cached uploads hold {held} bytes"


def test_allowed_ids_that_the_request_bans_until_min_tokens_or_for_good_are_refused(engine):
    """Allowed ids that are all stop ids held back by min_tokens (or all one-token bad words) leave a row with every
    logit masked: its argmax is id 0, which is not allowed (the engine wrote [0, 0, EOS] for allowed [EOS] with
    min_tokens 2). Such a request is refused, with the reason."""
    eos = engine.core.eos_ids[0]
    with pytest.raises(RequestError, match="min_tokens"):
        engine.generate("a", SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=4, seed=3))
    with pytest.raises(RequestError, match="min_tokens"):
        engine.generate("a", SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1, max_tokens=4))
    (a,) = engine.tokenizer.encode("a", add_special_tokens=False).ids
    with pytest.raises(RequestError, match="bad_words"):
        engine.generate("a", SamplingParams(allowed_token_ids=[a], bad_words=["a"], max_tokens=4))
    with pytest.raises(RequestError, match="bad_words or stop tokens"):  # (each id banned one way or the other)
        engine.generate("a", SamplingParams(allowed_token_ids=[eos, a], bad_words=["a"], min_tokens=2, max_tokens=4))
    # an allowed id left free keeps the request, and only allowed ids come out
    out = engine.generate("a", SamplingParams(allowed_token_ids=[eos, a], min_tokens=2, max_tokens=4, seed=3))
    assert set(out[0].outputs[0].token_ids) <= {eos, a} and out[0].outputs[0].token_ids[:2] == [a, a]
    with pytest.raises(RequestError, match="min_tokens"):  # (min_tokens holds the EOS back under ignore_eos too)
        engine.generate("a", SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=2, ignore_eos=True))
    with pytest.raises(RequestError, match="min_tokens"):  # (the front end's check, from the limits alone)
        RequestLimits(vocab_size=100, max_model_len=64, cache_tokens=1000, eos_ids=(9,)).check(
            [1, 2], SamplingParams(allowed_token_ids=[9], min_tokens=1))
