"""Reasoning models' thoughts apart from their answer (vLLM's --reasoning-parser): a chat reply's text before the end
of its thinking goes to `message.reasoning` (and `reasoning_content`, the field's older name, which DeepSeek's API
uses), the rest to `content`, streamed or whole.

deepseek_r1 (DeepSeek-R1 and its Llama distillations): thoughts end at `</think>`. Their chat template opens the
`<think>` in the prompt, so a reply begins inside the thoughts; a `<think>` the model writes itself is dropped. A
reply that never closes its thoughts (cut by max_tokens) is all reasoning, as vLLM reads it. A grammar the request
asks for holds only the answer after the thoughts (the server sets SamplingParams.structured_after to the end tag).
A prompt whose last tag is the end tag has closed the thoughts itself: its reply is all answer, held from the start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from tpgraph.errors import ConfigError
from tpgraph.server.tool_streams import tag_begun


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str  # the tag a reply may open its thoughts with (dropped)
    end: str  # the tag that ends them
    keeps_special_tokens: bool = False  # (the model's end tag is a special token: its text must not be skipped)

    def for_tokenizer(self, tokenizer: Tokenizer) -> ReasoningParser:
        """This parser checked against a model's tokenizer: the end tag must be one token (a grammar held off until
        the thoughts end waits for that token; engine/structured.py), and where it is a special token, replies keep
        special tokens' text (else the tag would be skipped, and the whole reply read as thoughts)."""
        ids = tokenizer.encode(self.end, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ConfigError(f"--reasoning-parser {self.name} needs a model whose tokenizer has {self.end} as one "
                              f"token; this one splits it into {len(ids)}")
        added = tokenizer.get_added_tokens_decoder().get(ids[0])
        return dataclasses.replace(self, keeps_special_tokens=bool(added is not None and added.special))

    def closed_in(self, prompt: str) -> bool:
        """Does the prompt close the thoughts already, its last tag the end tag (a final assistant message continued
        past them)? Then the reply is all answer, as vLLM reads such a prompt."""
        return prompt.rfind(self.end) > prompt.rfind(self.start)


PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>")}


@dataclass
class ReasoningReader:
    """One choice's reply split as it streams: feed() returns (reasoning, content) to send now. Only what is not
    sent yet is kept (a tag's beginning, held back), so a long reply costs no copies of itself."""

    parser: ReasoningParser
    unsent: str = ""
    thinking: bool = True
    started: bool = False  # past any opening tag
    blank: list[str] = field(default_factory=list)  # (not started) the reply's leading whitespace, in pieces

    def feed(self, text: str) -> tuple[str, str]:
        if self.thinking and not self.started and not self.unsent and text.isspace():
            # (held apart: added to unsent and stripped again for every token, a long run of it cost its square)
            self.blank.append(text)
            return "", ""
        self.unsent += text
        return self._split(final=False)

    def finish(self) -> tuple[str, str]:
        return self._split(final=True)

    def _split(self, final: bool) -> tuple[str, str]:
        if not self.thinking:
            content, self.unsent = self.unsent, ""
            return "", content
        start, end_tag = self.parser.start, self.parser.end
        if not self.started:
            head = self.unsent.lstrip()
            if start.startswith(head) and head != start and not final:
                return "", ""  # (maybe the opening tag, not whole yet)
            self.started = True
            # (whitespace before the opening tag is dropped with it; else it is the thoughts' beginning)
            self.unsent = head[len(start):] if head.startswith(start) else "".join(self.blank) + self.unsent
            self.blank = []
        end = self.unsent.find(end_tag)
        if end < 0:
            until = len(self.unsent) - (0 if final else tag_begun(self.unsent, end_tag))
            reasoning, self.unsent = self.unsent[:until], self.unsent[until:]
            return reasoning, ""
        reasoning, content = self.unsent[:end], self.unsent[end + len(end_tag):]
        self.unsent, self.thinking = "", False
        return reasoning, content
