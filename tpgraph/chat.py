"""Chat templates (rendered as HF's apply_chat_template renders them) and a checkpoint's generation_config.

A checkpoint's template is chat_template.jinja where there is one (transformers prefers it; other named ones are in
additional_chat_templates/), else tokenizer_config.json's `chat_template` (a string, or a list of named templates
whose "default" is used, and "tool_use" where tools are given). It is
rendered in a sandboxed Jinja environment with HF's settings (trim_blocks, lstrip_blocks, loop controls,
raise_exception, strftime_now, tojson, the `{% generation %}` tag) and the tokenizer's special tokens as variables.
The rendered text already holds BOS where the template puts it, so it is encoded without adding special tokens.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tpgraph.checks import positive_int
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.errors import CheckpointError, ConfigError, RequestError

logger = logging.getLogger(__name__)

# The built-in model's template: role headers as plain text around each message; tools, and an assistant's tool
# calls, as JSON.
BUILTIN_TEMPLATE = ("{{ bos_token }}{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
                    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                    "{{ m['tool_calls'] | tojson if m['tool_calls'] else '' }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# transformers' named special tokens, in its order (its special_tokens_map; template variables, as there)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the template's variables that a request's own fields set: chat_template_kwargs may not set them (documents may:
# vLLM's LLM.chat has no argument for them, and its server takes them where the request's documents field is unset)
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools"})
# apply_chat_template's own options in chat_template_kwargs, dropped: the request's add_generation_prompt and
# continue_final_message win over the kwargs' (vLLM's merge_kwargs), and its tokenize is no template variable (vLLM's
# safe_apply_chat_template takes it as its own argument: the prompt comes to the same tokens)
REQUEST_OPTIONS = frozenset({"add_generation_prompt", "continue_final_message", "tokenize"})
# the content parts vLLM reads as text (the Responses API's input_text and output_text, an assistant's refusal and
# earlier thoughts, as clients of reasoning models send them back), and the key holding each one's text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# the parts vLLM's parser skips where their text is null or missing (its PART_TYPES_TO_SKIP_NONE_CONTENT); in the
# string content format it drops every text part that comes to nothing (null, or empty)
NULL_SKIPPED_PARTS = frozenset({"text", "refusal"})


def content_text(content: Any, where: str, keep_empty: bool = False) -> Any:
    """A message's content as a template that renders it as a string takes it, as vLLM gives it: a list of OpenAI
    content parts as their texts joined by newlines (a part of any other kind refused), null as no text; anything
    else as it is. An empty text is left out before the join, as vLLM's _parse_chat_message_content_parts keeps only
    a part that parses to something (["a", "", "b"] is "a\nb"); keep_empty: joined too, as vLLM joins a tool
    message's parts in the "openai" format, each kept there as a {"type": "text"} object. where: the message, as
    refusals name it."""
    if content is None:
        return ""
    if not isinstance(content, (list, tuple)):
        return content
    texts = _part_texts(content, where, TEXT_PARTS)
    return "\n".join(texts if keep_empty else [t for t in texts if t])  # (as vLLM joins a message's text parts)


def content_parts(content: Any, where: str) -> Any:
    """A message's content as vLLM's "openai" content format gives it to a template that loops over the parts: each
    text part as {"type": "text", "text": ...}, a string as one such part, null as none; anything else as it is."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, (list, tuple)):
        return content
    return [{"type": "text", "text": text} for text in _part_texts(content, where, NULL_SKIPPED_PARTS)]


def _part_texts(content: list | tuple, where: str, skip_null: Any) -> list[str]:
    """The texts of a message's content parts (a plain string part is its own text, as vLLM takes it); a part of a kind
    in skip_null whose text is null or missing is left out, as vLLM's parser leaves it out (with a warning)."""
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        # (a type that is no string is no text part: a list or an object, unhashable, was a TypeError, a 500)
        key = TEXT_PARTS.get(kind) if isinstance(part, dict) and isinstance(kind, str) else None
        if key is None:
            raise RequestError(f"message content of type {kind!r} is not supported (text only)")
        text = part.get(key)
        if text is None and kind in skip_null:
            continue
        if not isinstance(text, str):  # (str() made a null the word "None" in the prompt)
            raise RequestError(f"{where}.content[{j}].{key} must be a string, got {text!r}")
        parts.append(text)
    return parts


def template_content(content: Any, where: str, content_format: str = "string", role: Any = None) -> Any:
    """A message's content in the content format ("string" or "openai") its template is given; a tool message's
    always as a string (vLLM joins its text parts whatever the format: templates read a tool result as text; in
    "openai" with its empty texts, as it keeps every part there)."""
    if content_format == "openai" and role != "tool":
        return content_parts(content, where)
    return content_text(content, where, keep_empty=content_format == "openai")


def text_messages(messages: list[Any], content_format: str = "string") -> list[Any]:
    """Chat messages as TPEngine.chat hands them to the template, as vLLM's LLM.chat does: their content as
    template_content gives it, an assistant's earlier tool calls as history_call gives them (an empty list dropped,
    as vLLM drops it) and its reasoning as reasoning_content too, a developer message's tools as developer_tools
    gives them. Copies: the caller's are left as they are; what is no message is left for the template's checks to
    name."""
    return [_template_message(m, i, content_format) if isinstance(m, dict) and "role" in m else m
            for i, m in enumerate(messages)]


def _template_message(m: dict[str, Any], i: int, content_format: str) -> dict[str, Any]:
    out = {**m, "content": template_content(m.get("content"), f"messages[{i}]", content_format, m["role"])}
    if m["role"] == "developer":
        out["tools"] = developer_tools(m.get("tools"), f"messages[{i}]")
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and isinstance(calls, list):
        set_history_calls(out, calls, i)
    # (vLLM's parser gives an assistant's reasoning under both keys, as the server's template_messages does: Qwen3's
    # and DeepSeek's templates read reasoning_content)
    if m["role"] == "assistant" and isinstance(m.get("reasoning"), str):
        out["reasoning_content"] = m["reasoning"]
    return out


def set_history_calls(message: dict[str, Any], calls: list, i: int) -> None:
    """message (messages[i], an assistant's, as the template gets it) with its earlier tool calls as history_call
    gives them; an empty list is dropped, as vLLM's _postprocess_messages drops it: a template asking `'tool_calls' in
    message` would take a plain reply for a turn of calls."""
    if calls:
        message["tool_calls"] = [history_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
    else:
        message.pop("tool_calls", None)


def developer_tools(tools: Any, where: str) -> list | None:
    """A developer message's own tools as vLLM's parser gives them to the template (_parse_chat_message_content sets
    `tools` on every developer message: None where it has none); the role itself is given as it is, not mapped to
    "system"."""
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"{where}.tools must be a list of tools, got {tools!r}")
    return tools


def history_call(call: Any, where: str) -> dict:
    """An assistant message's earlier tool call as a chat template takes it: arguments as the object their JSON text
    holds (Transformers' convention: templates write them out with tojson), as vLLM reads them (history_arguments)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    out = {"type": "function", "function": {"name": fn["name"], "arguments": history_arguments(fn.get("arguments"),
                                                                                               where, fn["name"])}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def history_arguments(args: Any, where: str, name: Any = None) -> dict:
    """An earlier call's arguments as newest vLLM hands them to the template (_postprocess_messages in its
    renderers/chat_utils/parse_chat_message.py): none (null, "", an empty value, JSON null) is {}; an object is kept;
    JSON text is parsed. Arguments that do not parse, or that hold no object (a list, a number, a string), are {}
    with a warning, as vLLM coerces them: the bad text lives in the conversation's history, and a 400 would fail
    every later turn of it too. (JSON that Python's parser cannot hold, an integer past its digit limit or nesting
    past its stack, is refused: vLLM's json.loads raises there, and its coercion catches only malformed JSON.)"""
    if not args:
        return {}
    if isinstance(args, dict):
        return args
    parsed = args
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            logger.warning("%s: tool call %r has arguments that are not valid JSON (%d chars); coercing them to an "
                           "empty object so the conversation can continue", where, name, len(args))
            return {}
        except (ValueError, RecursionError) as exc:  # (an integer past Python's digit limit; nesting past the stack)
            raise RequestError(f"{where}.function.arguments is JSON this server cannot parse: {exc}") from None
    if not isinstance(parsed, dict):
        if parsed is not None:
            logger.warning("%s: tool call %r arguments are %s, not a JSON object; coercing them to an empty object",
                           where, name, type(parsed).__name__)
        return {}
    return parsed


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}`, which marks the assistant's text for training masks: here it
    renders its body, as apply_chat_template does."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


# vLLM's chat_template_content_format: "auto" detects one of the other two from the template
CONTENT_FORMATS = ("auto", "string", "openai")


@functools.lru_cache(maxsize=32)
def detect_content_format(source: str) -> str:
    """vLLM's detection for content format "auto": "openai" (each message's content a list of text parts) where the
    template loops over a message's content (`for c in message['content']`, `for item in content`), else "string"."""
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    root = env.parse(source)
    loops = list(root.find_all(jinja2.nodes.For))
    messages = _names_bound_to(root, "messages")
    message = {loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name)
               and any(_reads(loop.iter, name) for name in messages)}
    for loop in loops:
        if any(_reads(loop.iter, name, "content") for name in message) or (
                isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content"):
            return "openai"
    return "string"


def _names_bound_to(root: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable set from it (`{% set rest = messages[1:] %}`), and from those, as vLLM follows them."""
    names, todo = {name}, [name]
    while todo:
        source = todo.pop()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and _reads(assign.node, source) and target.name not in names:
                names.add(target.name)
                todo.append(target.name)
    return names


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether node is `name` (or, with key, `name[key]` / `name.key`), through filters, tests and slices."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _reads(node.node, name)
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == key and _reads(node.node, name)


def _check_render_options(add_generation_prompt: Any, tools: Any, variables: Any, continue_final_message: Any) -> None:
    """A RequestError naming a chat option of the wrong type: chat_template_kwargs not a dict failed inside dict() (a
    ValueError about "sequence elements", or a list of pairs taken as variables), tools not a list reached the
    template as it was (a string rendered as a tool), and a truthy "no" meant yes."""
    if variables is not None and not isinstance(variables, Mapping):
        raise RequestError(f"chat_template_kwargs must be a dict of the template's variables, got "
                           f"{type(variables).__name__}")
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools)):
        got = type(tools).__name__ if not isinstance(tools, (list, tuple)) else \
            f"a list holding {', '.join(sorted({type(t).__name__ for t in tools if not isinstance(t, Mapping)}))}"
        raise RequestError(f"tools must be a list of tools ({{'type': 'function', 'function': {{...}}}}), got {got}")
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise RequestError(f"{name} must be True or False, got {value!r}")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 tool_use_source: str | None = None) -> None:
        """tool_use_source: a checkpoint's template named "tool_use", which apply_chat_template renders in place of
        the default one where tools are given."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
            self.tool_use_template = env.from_string(tool_use_source) if tool_use_source is not None else None
        except jinja2.TemplateError as exc:
            raise CheckpointError(f"the chat template does not parse: {exc}") from None
        self.source = source
        self.tool_use_source = tool_use_source
        self.special_tokens = dict(special_tokens or {})

    def __reduce__(self) -> tuple:
        # the compiled template does not pickle; the server's front-end process rebuilds it from the source
        return ChatTemplate, (self.source, self.special_tokens, self.tool_use_source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
               continue_final_message: bool = False, documents: list[dict] | None = None) -> str:
        """tools: function tools ({"type": "function", "function": {...}}), for templates that describe them.
        variables: more of the template's own variables (vLLM's chat_template_kwargs, e.g. a system prompt switch).
        continue_final_message: the text ends inside the last message (an assistant's reply begun), as HF's
        apply_chat_template cuts it, so the model continues it. documents: a RAG template's sources (vLLM's chat
        request field, each {"title", "text"}), as apply_chat_template gives them; where None, variables' own."""
        _check_render_options(add_generation_prompt, tools, variables, continue_final_message)
        variables = {k: v for k, v in (variables or {}).items() if k not in REQUEST_OPTIONS}
        taken = sorted(set(variables) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do")
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message continues the last message: it needs add_generation_prompt "
                               "false")
        if continue_final_message:
            messages = _with_end_mark(messages)
        template = self.tool_use_template if tools is not None and self.tool_use_template is not None else \
            self.template
        context = {**self.special_tokens, **variables}
        if documents is not None or "documents" not in context:  # (the request's field over chat_template_kwargs'
            context["documents"] = documents  # where it is set, as vLLM's merge_kwargs takes it)
        try:
            text = template.render(**context, messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:  # raise_exception in the template: the messages break its rules
            raise RequestError(f"the chat template refused these messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (anything else the template raised: vLLM's safe_apply_chat_template
            # makes every failure a ValueError, a 400; a variable of a type it cannot use, a range past the sandbox's
            # limit, a division by zero were a 500 here)
            raise RequestError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") \
                from None
        return _cut_at_end_mark(text) if continue_final_message else text

    def content_format(self, tools: list[dict] | None = None) -> str:
        """The content format ("string" or "openai") vLLM's "auto" gives the template rendered with these tools."""
        use_tool_template = tools is not None and self.tool_use_source is not None
        return detect_content_format(self.tool_use_source if use_tool_template else self.source)

    @staticmethod
    def from_option(value: str | Path, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
        """--chat-template: a file holding a template, or the template itself (as vLLM reads the flag)."""
        path = Path(value)
        try:
            is_file = path.is_file()
        except OSError:  # (a template too long to be a path)
            is_file = False
        if is_file:
            try:
                value = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"cannot read the chat template {path}: {exc}") from None
        elif isinstance(value, Path) or not any(c in value for c in "{}\n"):  # (a Path is never the template)
            raise CheckpointError(f"the chat template {str(value)!r} is neither a file nor a template")
        return ChatTemplate(value, special_tokens)

    @staticmethod
    def from_dir(model_dir: str | Path | None, builtin_bos: str) -> ChatTemplate | None:
        """The checkpoint's template; the built-in one for the built-in model; None if a checkpoint has none."""
        if model_dir is None:
            return ChatTemplate(BUILTIN_TEMPLATE, {"bos_token": builtin_bos})
        cfg = tokenizer_config(model_dir)
        # newer checkpoints keep the templates in their own files, which transformers prefers to the config's
        source = template_files(Path(model_dir)) or cfg.get("chat_template")
        tool_use = None
        if isinstance(source, list):
            source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if isinstance(source, dict):
            source, tool_use = source.get("default"), source.get("tool_use")
        if not isinstance(source, str):
            return None
        return ChatTemplate(source, special_tokens(cfg), tool_use if isinstance(tool_use, str) else None)


def template_files(model_dir: Path) -> dict[str, str]:
    """The templates a checkpoint keeps in files, by name, as transformers saves them: chat_template.jinja (the
    default) and additional_chat_templates/NAME.jinja ("tool_use", say); {} without any."""
    files = [model_dir / "chat_template.jinja", *sorted((model_dir / "additional_chat_templates").glob("*.jinja"))]
    named = {}
    for path in (f for f in files if f.is_file()):
        name = "default" if path.parent == model_dir else path.name.removesuffix(".jinja")
        try:
            named[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from None
    return named


# marks where the last message's text ends, for continue_final_message (a private-use character: no chat has it);
# its trailing space, as HF's tag's, tells whether the template trimmed the end of the message (Llama 3's `| trim`)
_CONTINUE_MARK = "\U000f0000tpgraph-continue\U000f0000 "


def _with_end_mark(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last message's text marked at its end: its last text part's, where its content is a list of parts (as
    apply_chat_template marks it)."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, str):
        return [*messages[:-1], {**messages[-1], "content": content + _CONTINUE_MARK}]
    texts = [j for j, part in enumerate(content) if isinstance(part, dict) and isinstance(part.get("text"), str)] \
        if isinstance(content, list) else []
    if not texts:
        raise RequestError("continue_final_message needs a last message with text to continue")
    j = texts[-1]
    marked = [*content[:j], {**content[j], "text": content[j]["text"] + _CONTINUE_MARK}, *content[j + 1:]]
    return [*messages[:-1], {**messages[-1], "content": marked}]


def _cut_at_end_mark(text: str) -> str:
    """The rendered text up to where the last message's text ends (what the template writes after it, an
    end-of-turn token, is cut), as apply_chat_template does for continue_final_message: where the template writes the
    message more than once, at its last (transformers' rindex; the earlier copies are kept, unmarked, where
    transformers leaves its tag in them); where the template trimmed the message's end (the mark's trailing space is
    gone), the whitespace before it goes too, as the template wrote none."""
    at = text.rfind(_CONTINUE_MARK.rstrip())
    if at < 0:
        raise RequestError("continue_final_message: the chat template does not write the last message's text")
    head = text[:at].replace(_CONTINUE_MARK, "").replace(_CONTINUE_MARK.rstrip(), "")
    return head if text.startswith(_CONTINUE_MARK, at) else head.rstrip()


def tokenizer_config(model_dir: str | Path) -> dict:
    """A checkpoint's tokenizer_config.json ({} without one), with the special tokens of its special_tokens_map.json
    where transformers reads them: a config without added_tokens_decoder (older checkpoints keep bos_token and
    eos_token there only, and a template's {{ bos_token }} would otherwise render as nothing)."""
    cfg = _json_object(Path(model_dir) / "tokenizer_config.json")
    if "added_tokens_decoder" not in cfg:
        token_map = _json_object(Path(model_dir) / "special_tokens_map.json")
        cfg = {**cfg, **{key: token_map[key] for key in SPECIAL_TOKEN_KEYS if token_map.get(key)}}
    return cfg


def _json_object(path: Path) -> dict:
    """A JSON object from a checkpoint's file ({} without the file)."""
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} holds a JSON {type(cfg).__name__}, not an object")
    return cfg


def special_tokens(cfg: dict) -> dict[str, str]:
    """The special tokens a tokenizer config names (bos_token, eos_token, ...: a string, or an added token's
    content)."""
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return special


# generation_config.json's values that become request defaults, as vLLM reads them (do_sample is not consulted)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # (or a directory holding a generation_config.json)


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json: the ids that end a generation, and default sampling values."""

    # None: there is no generation_config.json, and config.json's EOS ids stand in (as vLLM's, whose generation
    # config is then transformers' GenerationConfig.from_model_config); a file read gives its own, () where it has none
    eos_token_ids: tuple[int, ...] | None = None
    sampling: dict[str, float] = field(default_factory=dict)  # temperature, top_p, top_k, repetition_penalty
    max_tokens: int | None = None  # (its max_new_tokens) a request's limit where it sets none, as vLLM's server

    @staticmethod
    def from_dir(model_dir: str | Path | None, defaults: bool = True) -> GenerationDefaults:
        """defaults False: its EOS ids alone (--generation-config vllm), its sampling values neither read nor checked
        (none is served)."""
        if model_dir is None:
            return GenerationDefaults()
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return GenerationDefaults()
        cfg = _json_object(path)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if any(isinstance(t, bool) or not isinstance(t, int) for t in eos_ids):  # (a string id would never match)
            raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
        if not defaults:
            return GenerationDefaults(eos_ids)
        # as vLLM: these become the request defaults
        sampling = {key: cfg[key] for key in SAMPLING_DEFAULTS
                    if isinstance(cfg.get(key), (int, float)) and not isinstance(cfg.get(key), bool)}
        if isinstance(sampling.get("top_k"), float) and math.isfinite(sampling["top_k"]):
            sampling["top_k"] = int(sampling["top_k"])  # (as a request takes it; NaN and inf are left to be refused)
        try:  # checked now, as a request takes them: out of range, every request that leaves the field unset was
            # refused with a 400 naming a field the client never sent
            SamplingParams(**sampling)
        except RequestError as exc:
            raise CheckpointError(f"{path}: {exc} (fix or remove it: requests take it as their default)") from None
        limit = cfg.get("max_new_tokens")
        max_tokens = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
        return GenerationDefaults(eos_ids, sampling, max_tokens)

    @staticmethod
    def from_option(source: str | Path, model_dir: str | Path | None,
                    overrides: dict[str, Any] | None = None) -> GenerationDefaults:
        """vLLM's --generation-config and --override-generation-config. source "auto": the checkpoint's
        generation_config.json; "vllm": none of its defaults (its EOS ids still end a generation, as vLLM's); else a
        directory whose generation_config.json is read instead. overrides then set or, where null, unset values."""
        if source == "vllm":
            base = GenerationDefaults.from_dir(model_dir, defaults=False)
        elif source == "auto":
            base = GenerationDefaults.from_dir(model_dir)
        else:
            check_generation_config_dir(source)
            base = GenerationDefaults.from_dir(source)
        return base.overridden(overrides or {})

    def overridden(self, overrides: dict[str, Any]) -> GenerationDefaults:
        """These defaults with --override-generation-config's values: the sampling ones, and max_new_tokens."""
        check_overrides(overrides)
        sampling = {**self.sampling, **{k: v for k, v in overrides.items() if k in SAMPLING_DEFAULTS}}
        sampling = {k: v for k, v in sampling.items() if v is not None}
        max_tokens = overrides["max_new_tokens"] if "max_new_tokens" in overrides else self.max_tokens
        try:
            SamplingParams(**sampling)
        except RequestError as exc:
            raise ConfigError(f"--override-generation-config: {exc}") from None
        return GenerationDefaults(self.eos_token_ids, sampling, max_tokens)


def check_generation_config_dir(source: object) -> None:
    """--generation-config's directory: one that holds a generation_config.json (vLLM quietly takes none from a
    directory without one; a typo would then serve without the defaults asked for)."""
    if not isinstance(source, (str, Path)):
        raise ConfigError(f"generation_config must be 'auto', 'vllm' or a directory, got {source!r}")
    if not (Path(source) / "generation_config.json").is_file():
        raise ConfigError(f"generation_config {str(source)!r} is neither 'auto' (the checkpoint's), 'vllm' (none) nor "
                          f"a directory holding a generation_config.json")


def check_overrides(overrides: object) -> None:
    """--override-generation-config: the values vLLM takes from it, each a number (null unsets it). Any other key is
    refused: vLLM drops it unread, and a client would be served without the default its operator set."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"--override-generation-config must be a JSON object, got {overrides!r}")
    known = (*SAMPLING_DEFAULTS, "max_new_tokens")
    for key, value in overrides.items():
        if key not in known:
            raise ConfigError(f"--override-generation-config sets {key!r}, which is not served as a default; give "
                              f"{', '.join(known)}")
        if value is None:
            continue
        if key == "max_new_tokens":
            positive_int("--override-generation-config: max_new_tokens", value)
        if key == "top_k" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"--override-generation-config: top_k must be an integer, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"--override-generation-config: {key} must be a number, got {value!r}")
