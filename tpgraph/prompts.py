"""What turns a user's prompt into token ids, and back: the tokenizer, the chat template and the checkpoint's
generation defaults. TPEngine holds one; the server's front-end process gets a pickled copy, so it tokenizes and
renders without touching the engine process."""

from __future__ import annotations

import functools
import numbers
import operator
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypedDict

from tokenizers import Tokenizer

from tpgraph.chat import SPECIAL_TOKEN_KEYS, ChatTemplate, GenerationDefaults, text_messages
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.errors import RequestError
from tpgraph.tokenizer import unicode_to_byte

Prompt = str | list[int] | list[dict[str, str]]
_BYTE_OF = unicode_to_byte()  # (byte-level BPE vocabularies spell each byte as one of these characters)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # (SentencePiece's byte-fallback tokens)
# transformers' apply_chat_template options EngineTokenizer does not take (else they would reach the template unused;
# its documents are taken, as a template variable: ChatTemplate.render gives them to the template), each with the
# values that ask nothing of it, transformers' defaults, which scripts spell out (taken, and dropped)
NOT_TEMPLATE_VARIABLES: dict[str, tuple] = {
    "chat_template": (None,), "padding": (False, "do_not_pad"), "truncation": (False, None, "do_not_truncate"),
    "max_length": (None,), "return_tensors": (None,), "tokenizer_kwargs": (None, {}),
    "return_assistant_tokens_mask": (False,)}


# transformers' tokenizer(...) options EngineTokenizer does not take, each with the values that ask nothing of it (its
# defaults; return_attention_mask True is what is given anyway)
NOT_CALL_OPTIONS: dict[str, tuple] = {
    "text_pair": (None,), "padding": (False, "do_not_pad"), "truncation": (False, None, "do_not_truncate"),
    "max_length": (None,), "return_tensors": (None,), "return_attention_mask": (None, True),
    "return_token_type_ids": (None, False), "verbose": (True, False)}


def _asks_something(value: object, neutral: tuple) -> bool:
    """Whether an option's value is other than the ones that ask nothing of it (by type too: 0 is no False)."""
    return not any(value is n or (type(value) is type(n) and value == n) for n in neutral)


@dataclass
class PromptCodec:
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    generation_defaults: GenerationDefaults
    model_label: str  # names the checkpoint in messages
    eos_ids: tuple[int, ...] = ()  # the ids that end a generation (the tokenizer's EOS first, then the configs')
    special_tokens: dict[str, str] = field(default_factory=dict)  # tokenizer_config.json's bos_token, eos_token, ...
    # each token's text and bytes, by id, as token_text and token_bytes read them: a streamed token with top_logprobs
    # k names k + 1 tokens, and asking the tokenizer for each every time was ~10 us a token at k = 5
    _texts: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    _bytes: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def encode(self, prompt: Prompt, max_tokens: int | None = None) -> list[int]:
        """Text (BOS added as the tokenizer does), token ids as they are, or chat messages through the template (their
        content parts as text, as TPEngine.chat reads them). max_tokens: a text too long to fit in that many tokens
        however it tokenizes is refused without tokenizing."""
        if isinstance(prompt, str):
            return self.encode_text(prompt, max_tokens=max_tokens)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.encode_chat(self.render_chat(text_messages(prompt, self.content_format())), max_tokens)
        ids = token_ids(prompt)
        if ids is not None:
            return ids
        raise RequestError(f"a prompt is a string, a list of token ids or a list of chat messages, got "
                           f"{type(prompt).__name__}")

    def encode_chat(self, rendered: str, max_tokens: int | None = None) -> list[int]:
        """A chat rendered through its template -> ids: the template writes the special tokens (BOS too)."""
        return self.encode_text(rendered, add_special_tokens=False, max_tokens=max_tokens)

    def encode_text(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Text -> ids. Through encode_batch, which lets go of the GIL while it works (encode holds it: a 9 MB prompt
        froze the server's other requests for 11 s), so a caller on a thread leaves the event loop free."""
        _check_text(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # (the tokenizer only raises a TypeError)
            raise RequestError(f"the prompt is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at "
                               f"character {exc.start}") from None
        if max_tokens is not None and len(text) > max_tokens * self.max_token_chars:
            raise RequestError(f"the prompt has {len(text)} characters, more than {max_tokens} tokens of "
                               f"{self.model_label} can hold (at most {self.max_token_chars} characters a token)")
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's text can have: its string in the vocabulary has a character per byte
        (byte-level BPE) or more (SentencePiece's <0x..> byte tokens), and a byte decodes to at most a character."""
        return max(1, max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1))

    def content_format(self, tools: list[dict] | None = None, given: str = "auto",
                       template: ChatTemplate | None = None) -> str:
        """The content format ("string" or "openai") a chat's messages reach the template in: `given` (vLLM's
        chat_template_content_format) unless "auto", else what vLLM detects for the template (`template`, a call's
        own, or the served one) these tools pick."""
        template = self.chat_template if template is None else template
        if given != "auto" or template is None:
            return "string" if given == "auto" else given
        return template.content_format(tools)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
                    continue_final_message: bool = False, template: ChatTemplate | None = None,
                    documents: list[dict] | None = None) -> str:
        """Chat messages as text, through the chat template, or `template` in its place (ChatTemplate.render says
        what each argument does)."""
        template = self.chat_template if template is None else template
        if template is None:
            raise RequestError(f"{self.model_label} has no chat template (chat_template.jinja, or "
                               f"tokenizer_config.json's chat_template, or --chat-template); send a plain prompt")
        if not messages:  # (as vLLM's, whose apply_chat_template raises: else the generation prompt alone was run)
            raise RequestError("cannot apply the chat template to an empty conversation: give at least one message")
        for i, m in enumerate(messages):  # (a template renders a missing role as nothing: a prompt of garbage)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"chat message {i} has no role: messages are {{'role': ..., 'content': ...}}, got "
                                   f"{m!r} (vLLM's {{'prompt': ...}} and {{'prompt_token_ids': ...}} prompts are given "
                                   f"to generate alone or in a list of prompts, not among chat messages)")
        return template.render(messages, add_generation_prompt, tools, variables, continue_final_message, documents)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config defaults (its max_new_tokens as max_tokens, as
        vLLM's get_default_sampling_params), then `overrides`."""
        limit = self.generation_defaults.max_tokens
        limits = {} if limit is None else {"max_tokens": limit}
        return SamplingParams(**{**self.generation_defaults.sampling, **limits, **overrides})

    def tokenizer_info(self, max_model_len: int) -> dict[str, Any]:
        """vLLM's /tokenizer_info: what a client needs to tokenize as the server does (lm-eval's remote tokenizer
        reads the special tokens and the chat template here, then tokenizes through /tokenize). The special tokens
        are the tokenizer config's, as vLLM gives them; without one, the BOS the tokenizer adds and the text of the
        first EOS id."""
        special = self.special_tokens
        bos, eos = special.get("bos_token"), special.get("eos_token")
        if bos is None and (added := self.tokenizer.encode_batch([""], add_special_tokens=True)[0].ids):
            bos = self.tokenizer.id_to_token(added[0])
        if eos is None and self.eos_ids:
            eos = self.decode([self.eos_ids[0]])
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_model_len,
                "bos_token": bos, "eos_token": eos, "pad_token": special.get("pad_token"),
                "chat_template": self.chat_template.source if self.chat_template else None}

    def decode(self, token_ids: list[int]) -> str:
        """Ids -> text, special tokens spelled out (an echoed prompt given as ids, /detokenize)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes a token stands for (OpenAI's log-probability `bytes`, from which clients join a character split
        over tokens): a byte-level BPE token's own bytes, a byte-fallback token's byte, else its text in UTF-8. (Its
        text alone would give U+FFFD's three bytes for each part of a split character.) A new list each call."""
        kept = self._bytes.get(token_id)
        if kept is None:
            kept = self._bytes[token_id] = tuple(self._read_bytes(token_id))
        return list(kept)

    def _read_bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None:
            if type(self.tokenizer.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF for c in piece):
                return [_BYTE_OF[c] for c in piece]
            if (m := _BYTE_TOKEN.fullmatch(piece)) is not None:
                return [int(m.group(1), 16)]
        return list(self.token_text(token_id).encode())


def _check_text(text: object) -> None:
    """Text to tokenize must be a str: another type failed inside (an AttributeError, 'int' object has no attribute
    'encode', or the tokenizers library's TypeError), where transformers' encode says what it takes."""
    if not isinstance(text, str):
        raise RequestError(f"the text to tokenize must be a string, got {type(text).__name__} (token ids are a prompt "
                           f"as they are; decode turns them into text)")


class Encoded(dict):
    """What EngineTokenizer(text) gives: a dict of "input_ids" and "attention_mask", also read as attributes
    (tokenizer(text).input_ids), as transformers' BatchEncoding is."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _special_token(name: str) -> tuple[property, property]:
    """EngineTokenizer's `name` (the tokenizer config's token, or None) and `name`_id (its id, or None), each set as
    transformers' are (`tok.pad_token = tok.eos_token`, `tok.pad_token_id = 0`: a script's padding token): on this
    tokenizer alone, the engine's own special tokens unchanged."""
    def set_token(self: EngineTokenizer, value: str | None) -> None:
        if value is not None and not isinstance(value, str):  # (transformers refuses it alike)
            raise RequestError(f"cannot set a non-string value as the {name}, got {value!r}")
        self._set_tokens[name] = value

    def set_id(self: EngineTokenizer, value: int | None) -> None:
        set_token(self, None if value is None else self.backend_tokenizer.id_to_token(operator.index(value)))

    token = property(lambda self: self._special_tokens().get(name), set_token)
    token_id = property(lambda self: None if (t := self._special_tokens().get(name)) is None
                        else self.backend_tokenizer.token_to_id(t), set_id)
    return token, token_id


class EngineTokenizer:
    """What TPEngine.get_tokenizer() returns (vLLM's LLM.get_tokenizer() gives a transformers tokenizer): the engine's
    tokenizer, chat template and special tokens behind the names of transformers' tokenizer methods and attributes
    that scripts call on it, with their defaults (encode adds the special tokens, decode and apply_chat_template's
    add_generation_prompt leave them out). `backend_tokenizer` is the `tokenizers.Tokenizer` itself."""

    def __init__(self, codec: PromptCodec) -> None:
        self.codec = codec
        self.backend_tokenizer: Tokenizer = codec.tokenizer
        self._set_tokens: dict[str, str | None] = {}  # special tokens a script set on this tokenizer (None: unset)

    def _special_tokens(self) -> dict[str, str]:
        """The named special tokens: the tokenizer config's, and those set on this tokenizer."""
        merged = {**self.codec.special_tokens, **self._set_tokens}
        return {key: token for key, token in merged.items() if token is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.codec.encode_text(text, add_special_tokens=add_special_tokens)

    def __call__(self, text: str | list[str], *pair: Any, add_special_tokens: bool = True, **options: Any) -> Encoded:
        """tokenizer(text) or tokenizer([texts]): {"input_ids", "attention_mask"} (also as attributes), each a list
        for one text or a list of lists for several, as transformers' BatchEncoding holds them unpadded. Its options
        (padding, truncation, max_length, return_tensors, text_pair, by name or as transformers' second positional
        argument...) are refused where they ask something, not taken and ignored (at transformers' defaults,
        padding=False or return_tensors=None, which scripts spell out, they are taken)."""
        if pair:
            options = {"text_pair": pair[0], **options}
        asked = sorted(k for k, v in options.items() if k not in NOT_CALL_OPTIONS
                       or _asks_something(v, NOT_CALL_OPTIONS[k]))
        if asked:
            raise RequestError(f"tokenizer(...) here takes text and add_special_tokens alone, not "
                               f"{', '.join(asked)} (transformers' options): pad, truncate or make tensors "
                               f"of the input_ids it gives")
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoded(input_ids=ids, attention_mask=[1] * len(ids))
        if not isinstance(text, (list, tuple)) or not all(isinstance(t, str) for t in text):
            raise RequestError(f"tokenizer(...) takes a text or a list of texts, got {type(text).__name__}")
        ids = [self.encode(t, add_special_tokens) for t in text]
        return Encoded(input_ids=ids, attention_mask=[[1] * len(i) for i in ids])

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The text's tokens as the vocabulary spells them (transformers' tokenize: no special tokens unless asked)."""
        _check_text(text)
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].tokens

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Ids -> text; one id (an int, numpy's too, or a 0-d tensor or array) is its token's text, as transformers
        takes it (its to_py_obj reads tensors and arrays as lists, a 0-d one as its number).
        clean_up_tokenization_spaces (transformers', which scripts pass, False mostly: a TypeError here) changes
        nothing, as transformers 5 ignores it for a BPE tokenizer such as Llama's (its clean-up, meant for WordPiece,
        strips spaces the text had before punctuation)."""
        if clean_up_tokenization_spaces is not None and not isinstance(clean_up_tokenization_spaces, bool):
            raise RequestError(f"clean_up_tokenization_spaces must be True, False or None, got "
                               f"{clean_up_tokenization_spaces!r}")
        if hasattr(token_ids, "tolist"):  # (list() of a 0-d tensor or array raised a TypeError)
            token_ids = token_ids.tolist()
        ids = [int(token_ids)] if isinstance(token_ids, numbers.Integral) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in sequences]

    def apply_chat_template(self, conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
                            tools: list[dict] | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, return_dict: bool = False,
                            **kwargs: Any) -> Any:
        """The conversation through the engine's chat template (as TPEngine.chat renders it): the text, or with
        tokenize its token ids (the template writes the special tokens; transformers 4's list, or with return_dict
        5's {"input_ids", "attention_mask"}); a list of conversations gives a list of each (a dict of lists), as
        transformers batches them. Other keywords are template variables, as in transformers, but for its
        own options that are not taken here (NOT_TEMPLATE_VARIABLES), refused rather than handed to the template
        where they ask something (padding=True), dropped where they ask nothing (padding=False, return_tensors=None:
        transformers' defaults, which a script may spell out)."""
        refused = sorted(k for k in kwargs if k in NOT_TEMPLATE_VARIABLES
                         and _asks_something(kwargs[k], NOT_TEMPLATE_VARIABLES[k]))
        kwargs = {k: v for k, v in kwargs.items() if k not in NOT_TEMPLATE_VARIABLES}
        if refused:
            raise RequestError(f"apply_chat_template here takes no {', '.join(refused)} (transformers' options): "
                               f"tokenize=False gives the text to tokenize or pad as you need")
        batch = isinstance(conversation, (list, tuple)) and bool(conversation) \
            and isinstance(conversation[0], (list, tuple))  # (a list of conversations: a list for each answer)
        texts = [self.codec.render_chat(list(c), add_generation_prompt, tools, kwargs, continue_final_message)
                 for c in (conversation if batch else [conversation])]
        if not tokenize:
            return texts if batch else texts[0]
        ids = [self.codec.encode_chat(text) for text in texts]
        if not return_dict:
            return ids if batch else ids[0]
        masks = [[1] * len(i) for i in ids]
        return Encoded(input_ids=ids, attention_mask=masks) if batch else Encoded(input_ids=ids[0],
                                                                                  attention_mask=masks[0])

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:  # (the whole vocabulary, added tokens too, as transformers counts it)
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:  # (without the added tokens, as transformers counts it)
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    # the named special tokens and their ids, as transformers reads them from the tokenizer config: None where it
    # names none (Llama checkpoints mostly name no pad token; and the ids that end a generation, from the model's config
    # and generation_config.json, are the engine's, not the tokenizer's eos_token_id)
    eos_token, eos_token_id = _special_token("eos_token")
    bos_token, bos_token_id = _special_token("bos_token")
    pad_token, pad_token_id = _special_token("pad_token")
    unk_token, unk_token_id = _special_token("unk_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens the tokenizer config sets, or a script set on this tokenizer (bos_token,
        eos_token, unk_token, sep_token, pad_token, cls_token, mask_token), in transformers' order."""
        special = self._special_tokens()
        return {key: special[key] for key in SPECIAL_TOKEN_KEYS if key in special}

    @property
    def all_special_tokens(self) -> list[str]:
        """special_tokens_map's tokens, each once. (transformers adds the config's additional_special_tokens, which
        are not read here: tokens the config lists only there are missing.)"""
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int | None]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self.codec.chat_template.source if self.codec.chat_template is not None else None


def is_one_prompt(prompts: object) -> bool:
    """One prompt rather than a list of them: text, chat messages, or token ids (a list or tuple of scalars, or a 1-D
    integer array or tensor; a 1-D array of strings is a list of texts)."""
    if isinstance(prompts, str):
        return True
    if getattr(prompts, "ndim", None) == 1:
        return "int" in str(getattr(prompts, "dtype", ""))
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return False
    first = prompts[0]  # (chat messages, or a scalar: an id, or a mistake that encode names)
    return isinstance(first, dict) or (not isinstance(first, (str, bytes, list, tuple))
                                       and getattr(first, "ndim", 0) == 0)


def is_vllm_prompt(prompt: object) -> bool:
    """vLLM's TextPrompt or TokensPrompt: a dict with "prompt" or "prompt_token_ids" (a chat message has a role)."""
    return isinstance(prompt, dict) and "role" not in prompt and ("prompt" in prompt or "prompt_token_ids" in prompt)


class TextPrompt(TypedDict):
    """vLLM's TextPrompt (its scripts make prompts with it): {"prompt": text}."""

    prompt: str


class _IdsPrompt(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_IdsPrompt, total=False):
    """vLLM's TokensPrompt: {"prompt_token_ids": ids}, with "prompt", the text they stand for, where known."""

    prompt: str


class TextedIds(NamedTuple):
    """vLLM's TokensPrompt holding the text its ids stand for: the ids are run, the text is the output's prompt."""

    text: str
    ids: list[int]


class SaltedPrompt(NamedTuple):
    """A vLLM prompt dict with a cache_salt: the prompt it holds and its salt (that prompt's SamplingParams.cache_salt,
    as vLLM's prompt dicts carry it)."""

    prompt: str | list[int] | TextedIds
    salt: str


def unsalted(prompts: list) -> tuple[list, list[str | None]]:
    """The prompts with each SaltedPrompt's prompt in its place, and each one's cache_salt (None where it gave none)."""
    return ([p.prompt if isinstance(p, SaltedPrompt) else p for p in prompts],
            [p.salt if isinstance(p, SaltedPrompt) else None for p in prompts])


def vllm_prompt(prompt: dict) -> str | list[int] | TextedIds | SaltedPrompt:
    """vLLM's {"prompt": text} or {"prompt_token_ids": ids} as the text or the ids it holds (as generate takes them);
    {"prompt_token_ids": ids, "prompt": text} as both (TextedIds); with a "cache_salt", a SaltedPrompt of that. Its
    other keys (multi_modal_data, ...) ask for what tpgraph does not do here: refused, named."""
    keys = sorted((k for k in prompt if k != "cache_salt"), key=str)
    if keys not in (["prompt"], ["prompt_token_ids"], ["prompt", "prompt_token_ids"]):
        raise RequestError(f"a vLLM prompt here holds 'prompt' (text), 'prompt_token_ids' or both (ids and the text "
                           f"they stand for), with a 'cache_salt' if any, got the keys {sorted(prompt, key=str)} "
                           f"(tpgraph runs text-only models: no multi-modal data)")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):  # (as SamplingParams says it)
        raise RequestError(f"cache_salt must be a non-empty string if given, got {salt!r}")
    held = _held_prompt(prompt)
    return held if salt is None else SaltedPrompt(held, salt)


def _held_prompt(prompt: dict) -> str | list[int] | TextedIds:
    text = prompt.get("prompt")
    if "prompt" in prompt and not isinstance(text, str):
        raise RequestError(f"prompt must be text, got {type(text).__name__}")
    if "prompt_token_ids" not in prompt:
        return text
    ids = token_ids(prompt["prompt_token_ids"])
    if ids is None:
        raise RequestError(f"prompt_token_ids must be a list of token ids, got "
                           f"{type(prompt['prompt_token_ids']).__name__}")
    return ids if text is None else TextedIds(text, ids)


def token_ids(prompt: object) -> list[int] | None:
    """A prompt given as token ids (a list or tuple of integers, numpy's among them, or a 1-D integer array or tensor)
    as a list; None for anything that is not a sequence of ids. An id that is not an integer is refused, named."""
    if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):
        prompt = prompt.tolist()  # (a float array's items are then floats, refused below)
    if not isinstance(prompt, (list, tuple)) or any(isinstance(t, (dict, str, list, tuple)) for t in prompt):
        return None
    ids = []
    for i, t in enumerate(prompt):
        try:
            if isinstance(t, bool):  # (an int to Python, but never meant as one)
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise RequestError(f"token ids must be integers, got {t!r} ({type(t).__name__}) at position {i}") from None
    return ids
