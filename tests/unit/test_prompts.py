"""PromptCodec: prompts to ids, refusing text that is not valid Unicode or too long to fit, and tokenizing without
holding the GIL (the server's event loop runs on while a long prompt is encoded on a thread)."""

import threading
import time

import pytest

from tpgraph.chat import GenerationDefaults
from tpgraph.errors import RequestError
from tpgraph.prompts import PromptCodec
from tpgraph.tokenizer import builtin_tokenizer

CODEC = PromptCodec(builtin_tokenizer(), None, GenerationDefaults(), "the built-in model")


def test_text_ids_and_token_ids():
    assert CODEC.encode("hé") == [256, ord("h"), 0xC3, 0xA9]  # BOS, then the bytes
    assert CODEC.encode_text("hé", add_special_tokens=False) == [ord("h"), 0xC3, 0xA9]
    assert CODEC.encode([5, 7]) == [5, 7]
    assert CODEC.encode((5, 7)) == [5, 7]
    with pytest.raises(RequestError, match="token ids must be integers, got True"):
        CODEC.encode([True, 2])
    with pytest.raises(RequestError, match="a prompt is a string, a list of token ids or a list of chat messages"):
        CODEC.encode(b"ab")


@pytest.mark.parametrize("prompt", [[{"prompt": "hi"}], [{"prompt_token_ids": [256, 104]}],
                                    [{"role": "user", "content": "a"}, {"content": "b"}]])
def test_dicts_that_are_not_chat_messages_are_refused(prompt):
    """vLLM's prompt dicts ({"prompt": ...}, {"prompt_token_ids": ...}), a list of dicts like chat messages, were
    rendered through the template with no role and no content: a prompt of template text alone."""
    from tpgraph.chat import BUILTIN_TEMPLATE, ChatTemplate
    from tpgraph.tokenizer import BOS

    codec = PromptCodec(builtin_tokenizer(), ChatTemplate(BUILTIN_TEMPLATE, {"bos_token": BOS}), GenerationDefaults(),
                        "the built-in model")
    assert codec.encode([{"role": "user", "content": "a"}]) == codec.encode_text(
        f"{BOS}<|user|>\na\n<|assistant|>\n", add_special_tokens=False)
    with pytest.raises(RequestError, match="has no role"):
        codec.encode(prompt)


@pytest.mark.parametrize("text,at", [("\ud800", 0), ("ab\udfffc", 2)])
def test_a_lone_surrogate_is_refused_with_where_it_is(text, at):
    with pytest.raises(RequestError, match=f"lone surrogate U\\+{ord(text[at]):04X} at character {at}"):
        CODEC.encode(text)


def test_text_too_long_for_any_tokenization_is_refused_before_tokenizing():
    assert CODEC.max_token_chars == len("<|begin_of_text|>")  # the longest token (an added one) of the byte vocab
    fits = "x" * (100 * CODEC.max_token_chars)
    with pytest.raises(RequestError, match=f"{len(fits) + 1} characters, more than 100 tokens"):
        CODEC.encode(fits + "x", max_tokens=100)
    assert len(CODEC.encode(fits, max_tokens=100)) == len(fits) + 1  # (the bound only refuses what cannot fit)


def test_tokenizing_lets_other_threads_run():
    """tokenizers' encode holds the GIL for the whole call (a 9 MB prompt: 11 s); encode_text must not: a thread
    that wakes every 5 ms keeps waking while the main thread tokenizes."""
    text = "ab " * 600_000
    gaps: list[float] = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.005)
            gaps.append(time.perf_counter() - t)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    start = time.perf_counter()
    CODEC.encode_text(text)
    took = time.perf_counter() - start
    stop.set()
    ticker.join()
    assert took > 0.2, took  # long enough that a held GIL would show
    assert max(gaps) < took / 2, (max(gaps), took)


def test_token_bytes_are_the_bytes_a_token_stands_for():
    """OpenAI's log-probability `bytes`: a character split over tokens is joined from them (its parts' text would be
    U+FFFD each, three bytes of EF BF BD)."""
    from tokenizers import Tokenizer, decoders, models

    assert [CODEC.token_bytes(t) for t in CODEC.encode_text("你", add_special_tokens=False)] == [[0xE4], [0xBD], [0xA0]]
    assert CODEC.token_bytes(256) == list(b"<|begin_of_text|>")
    byte_level = Tokenizer(models.BPE(vocab={"Ġhi": 0, "Ã¤": 1}, merges=[]))  # (GPT-2's spelling of " hi", C3 A4)
    byte_level.decoder = decoders.ByteLevel()
    codec = PromptCodec(byte_level, None, GenerationDefaults(), "m")
    assert codec.token_bytes(0) == list(b" hi") and codec.token_bytes(1) == list("ä".encode())
    fallback = Tokenizer(models.BPE(vocab={"<0xE4>": 0, "▁the": 1, "<unk>": 2}, merges=[], unk_token="<unk>"))
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    codec = PromptCodec(fallback, None, GenerationDefaults(), "m")
    assert codec.token_bytes(0) == [0xE4] and codec.token_bytes(1) == list(b" the")


def test_apply_chat_templates_options_at_transformers_defaults_are_taken(tmp_path):
    """LLM.get_tokenizer().apply_chat_template: a script that spells out transformers' defaults (padding=False,
    truncation=False, return_tensors=None, chat_template=None...) ran on transformers' tokenizer under vLLM but was
    refused here ("takes no padding"), though it asks nothing; one that asks something is still refused."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tpgtest.chat_fixtures import make_chat_checkpoint

    from tpgraph.chat import ChatTemplate
    from tpgraph.prompts import EngineTokenizer

    ckpt = make_chat_checkpoint(tmp_path / "chat")
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok = EngineTokenizer(PromptCodec(tokenizer, ChatTemplate.from_dir(ckpt, ""), GenerationDefaults(), "chat"))
    chat = [{"role": "user", "content": "hi"}]
    defaults = {"padding": False, "truncation": False, "return_tensors": None, "max_length": None,
                "chat_template": None, "tokenizer_kwargs": None, "return_assistant_tokens_mask": False}
    for tokenize in (False, True):
        theirs = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize, return_dict=False,
                                        **defaults)
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize, **defaults) == theirs
    for asked in ({"padding": True}, {"return_tensors": "pt"}, {"truncation": 0}, {"max_length": 8}):
        with pytest.raises(RequestError, match=f"apply_chat_template here takes no {next(iter(asked))}"):
            tok.apply_chat_template(chat, **asked)


def test_calling_the_tokenizer_with_transformers_defaults_spelled_out_encodes_as_transformers(tmp_path):
    """tokenizer(texts, padding=False, truncation=False, return_tensors=None) asks nothing of transformers' tokenizer
    beyond tokenizer(texts), and encodes so under vLLM; here it was refused ("not padding, return_tensors")."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tpgtest.chat_fixtures import make_chat_checkpoint

    from tpgraph.prompts import EngineTokenizer

    ckpt = make_chat_checkpoint(tmp_path / "chat")
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    tok = EngineTokenizer(PromptCodec(Tokenizer.from_file(str(ckpt / "tokenizer.json")), None, GenerationDefaults(),
                                      "chat"))
    defaults = {"padding": False, "truncation": False, "return_tensors": None, "max_length": None,
                "return_attention_mask": None, "text_pair": None}
    for texts in ("hi there", ["a", "bcd"]):
        assert dict(tok(texts, **defaults)) == dict(hf(texts, **defaults)) == dict(hf(texts))
    with pytest.raises(RequestError, match="not padding, return_tensors"):
        tok(["a", "bc"], padding=True, return_tensors="pt", truncation=False)


class CountingTokenizer:
    """A tokenizer that counts its decode and id_to_token calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def decode(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer.decode(*args, **kwargs)

    def id_to_token(self, *args):
        self.calls += 1
        return self.tokenizer.id_to_token(*args)


def test_a_tokens_text_and_bytes_are_read_from_the_tokenizer_once():
    """Each streamed token with top_logprobs k names k + 1 tokens by text and bytes (chat), the tokenizer asked for
    each every time: ~10 us a token at k = 5 (bench/bench_server_tokens.py --logprobs 5). They are kept per id; a
    caller that changes a list it was given changes nothing kept."""
    tokenizer = CountingTokenizer(builtin_tokenizer())
    codec = PromptCodec(tokenizer, None, GenerationDefaults(), "m")
    first = [codec.token_text(0xE4), codec.token_bytes(0xE4), codec.token_text(256), codec.token_bytes(256)]
    asked = tokenizer.calls
    assert [[codec.token_text(0xE4), codec.token_bytes(0xE4), codec.token_text(256), codec.token_bytes(256)]
            for _ in range(3)] == [first] * 3
    assert tokenizer.calls == asked
    codec.token_bytes(0xE4).append(0)
    assert codec.token_bytes(0xE4) == [0xE4] and codec.token_text(7, as_id=True) == "token_id:7"
    assert first == ["\ufffd", [0xE4], "<|begin_of_text|>", list(b"<|begin_of_text|>")]
