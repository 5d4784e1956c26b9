"""Reasoning models' thoughts split from their answer (--reasoning-parser deepseek_r1): streamed in any chunking or
whole, with tool calls after the thoughts, through the chat endpoint."""

import json
import random

import pytest
from tpgtest.copies import CountedText

from tpgraph.server.reasoning import PARSERS, ReasoningReader
from tpgraph.server.reply import ReplyReader
from tpgraph.server.tools import ToolOptions, ToolPlan

R1 = PARSERS["deepseek_r1"]


def split(text: str, chunks: list[str] | None = None) -> tuple[str, str]:
    reader, reasoning, content = ReasoningReader(R1), "", ""
    for chunk in chunks or [text]:
        r, c = reader.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = reader.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("Let me think.</think>\n\nThe answer is 4.", "Let me think.", "\n\nThe answer is 4."),  # (template opened it)
    ("<think>\nHmm.</think>Four.", "\nHmm.", "Four."),  # (the model opened it: the tag is dropped)
    ("Still thinking when cut", "Still thinking when cut", ""),  # (never closed: all reasoning)
    ("</think>Straight to it.", "", "Straight to it."),
    ("a</think>b</think>c", "a", "b</think>c"),  # (only the first end tag ends the thoughts)
    ("<thin", "<thin", ""),  # (a reply that only looked like an opening tag)
])
def test_deepseek_r1_split(text, reasoning, content):
    assert split(text) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(50):  # any chunking streams the same split, a tag cut anywhere
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert split(text, chunks) == (reasoning, content), chunks


def test_a_partial_end_tag_is_held_until_it_is_whole():
    reader = ReasoningReader(R1)
    assert reader.feed("Thinking</th") == ("Thinking", "")
    assert reader.feed("ink>Done") == ("", "Done")


def test_thoughts_then_tool_calls_and_the_whole_message():
    plan = ToolPlan.of([{"type": "function", "function": {"name": "f"}}], None, None, ToolOptions(parser="hermes"))
    text = 'I should call f.</think><tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    reply, streamed = ReplyReader(plan, ReasoningReader(R1)), []
    for i in range(0, len(text), 4):
        streamed.append(reply.feed(text[i:i + 4]))
    rest, reason = reply.finish("stop")
    streamed.append(rest)
    assert "".join(d.reasoning for d in streamed) == "I should call f." and reason == "tool_calls"
    message = reply.message()
    assert message["reasoning"] == message["reasoning_content"] == "I should call f." and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert streamed[0].fields(plain=False) == {"reasoning": "I sh", "reasoning_content": "I sh"}


def test_a_named_call_begins_with_the_answer_and_a_reply_cut_while_thinking_makes_none():
    plan = ToolPlan.of([{"type": "function", "function": {"name": "f"}}],
                       {"type": "function", "function": {"name": "f"}}, None, ToolOptions())
    reply = ReplyReader(plan, ReasoningReader(R1))
    assert reply.feed("Let me see").calls == []
    rest, reason = reply.finish("length")
    assert rest.calls == [] and reason == "length"
    assert reply.message() == {"role": "assistant", "content": None, "reasoning": "Let me see",
                               "reasoning_content": "Let me see"}
    reply = ReplyReader(plan, ReasoningReader(R1))
    assert reply.feed("Hmm</think>").calls == []
    (call,) = reply.feed('{"x": 1}').calls
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_the_end_tag_must_be_one_token_and_a_special_one_keeps_special_tokens():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tpgraph.errors import ConfigError
    from tpgraph.tokenizer import builtin_tokenizer

    with pytest.raises(ConfigError, match="has </think> as one token; this one splits it into"):
        R1.for_tokenizer(builtin_tokenizer())
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens(["</think>"])
    assert not R1.for_tokenizer(tok).keeps_special_tokens  # (an added token, not special: its text stays)
    tok.add_special_tokens(["<other>"])
    assert not R1.for_tokenizer(tok).keeps_special_tokens  # (another special token changes nothing)
    special = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    special.add_special_tokens(["</think>"])
    assert R1.for_tokenizer(special).keeps_special_tokens


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_a_reply_with_no_answer_has_null_content_whether_or_not_its_thoughts_are_sent(include_reasoning):
    """Cut while thinking (or thoughts closed with nothing after): content is null, as vLLM answers, also where
    include_reasoning false leaves the thoughts out (it was "" there, null beside them)."""
    plan = ToolPlan.of(None, None, None, ToolOptions())
    for text in ("Still thinking", "Done.</think>"):
        reply = ReplyReader(plan, ReasoningReader(R1), include_reasoning=include_reasoning)
        reply.feed(text)
        reply.finish("length")
        message = reply.message()
        assert message["content"] is None, (text, message)
        assert message["reasoning"] == (text.removesuffix("</think>") if include_reasoning else None)


class _Thoughts:
    """A reasoning reader whose every piece is thoughts, as CountedText."""

    def feed(self, text: str) -> tuple[str, str]:
        return CountedText(text), ""

    def finish(self) -> tuple[str, str]:
        return "", ""


def test_a_long_thought_is_kept_without_copying_it_for_every_piece():
    """The reply's reasoning was kept by += on the reader's field, copying all of it again for every token (the
    square of its length); its pieces are now joined once, when the message is read."""
    plan = ToolPlan.of(None, None, None, ToolOptions())
    reply = ReplyReader(plan, _Thoughts())
    CountedText.copied = 0
    for _ in range(2000):
        reply.feed("word ")
    reply.finish("length")
    assert reply.message()["reasoning"] == "word " * 2000
    assert CountedText.copied <= 4 * len("word " * 2000), CountedText.copied


@pytest.mark.parametrize(("after", "reasoning", "content"), [
    ("<think>Hmm.</think>Four.", "Hmm.", "Four."),  # (the whitespace before the opening tag is dropped with it)
    ("Hmm.</think>Four.", "\n" * 3000 + "Hmm.", "Four."),  # (no opening tag: the thoughts begin with it)
    ("", "\n" * 3000, ""),  # (nothing but whitespace, cut)
], ids=["opening-tag", "no-opening-tag", "whitespace-only"])
def test_a_reply_opening_with_a_long_run_of_whitespace_is_held_without_copying_it_for_every_token(after, reasoning,
                                                                                                 content):
    """While the reply might still open its thoughts with <think>, its leading whitespace was added to the text held
    back (and stripped again) for every token: a reply opening with a long run of newlines cost the square of it."""
    CountedText.copied = 0
    chunks = [CountedText("\n")] * 3000 + ([after] if after else [])
    assert split("", chunks) == (reasoning, content)
    assert CountedText.copied <= 4 * 3000 + 100, CountedText.copied
    # a prompt that closed the thoughts: the whitespace is the answer's, sent as it comes
    reader = ReasoningReader(R1, thinking=False)
    assert [reader.feed("\n"), reader.feed("Four."), reader.finish()] == [("", "\n"), ("", "Four."), ("", "")]
