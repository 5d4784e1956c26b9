"""A request under way on the server: each choice as it is built, and the engine's updates once submitted. A chat
turn (ChatTurn) is what the chat route and the Responses API (responses.py) share: the rendered prompt, its params,
and each choice's reply reader (reasoning, content, tool calls)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tpgraph.engine.beam_search import BeamSearchParams
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.engine.updates import StepUpdate
from tpgraph.server.reply import Delta, ReplyReader
from tpgraph.server.tools import ToolPlan


@dataclass
class Choice:
    """One choice being built: text, token ids, log-probabilities, finish reason."""

    index: int
    keeps_text: bool = True  # (a streamed or chat choice sends its text as it comes: none is kept here)
    parts: list[str] = field(default_factory=list)  # the text's pieces (joined once read: += copies it all per token)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS, ...)
    cached_tokens: int | None = None  # its prompt tokens read from the prefix cache (with its first token)

    @property
    def text(self) -> str:
        if not self.keeps_text:  # (a streamed or chat choice: its text went out as it came)
            raise RuntimeError(f"choice {self.index} keeps no text")
        return "".join(self.parts)

    def add(self, u: StepUpdate) -> Choice:
        if u.text and self.keeps_text:
            self.parts.append(u.text)
        if u.cached_tokens is not None:
            self.cached_tokens = u.cached_tokens
        if u.token_id is not None:
            self.token_ids.append(u.token_id)
            if u.logprob is not None:
                self.logprobs.append((u.token_id, u.logprob, u.top_logprobs or []))
        if u.finish_reason is not None:
            self.finish_reason, self.stop_reason = u.finish_reason, u.stop_reason
        return self


_END = object()
NOT_BEGUN = object()  # (a turn's first item) not taken yet: ChatTurn.begin takes it


async def submitted(stream: AsyncIterator) -> object:
    """Run the stream to its first item (submitting the request, so refusals raise here)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


async def chained(first: object, stream: AsyncIterator) -> AsyncIterator:
    """The stream's items, `first` (what submitted took) first."""
    if first is _END:
        return
    yield first
    async for item in stream:
        yield item


@dataclass
class RenderedChat:
    """A chat request's prompt: what its tools ask, the reply's role, the echoed text (vLLM's echo), the prompt the
    template rendered and its token ids (one prompt), and the reply's token limit."""

    tools: ToolPlan
    role: str
    echoed: str
    text: str
    token_ids: list[list[int]]
    max_tokens: int | None


@dataclass
class ChatTurn:
    """A chat request submitted to the engine: the prompt rendered from its messages, its params, each choice with the
    reader of its reply, and the engine's updates (a refusal raised as the turn began, so it is a 400)."""

    text: str  # the rendered prompt
    token_ids: list[list[int]]  # (one prompt)
    params: SamplingParams
    role: str  # the reply's
    echoed: str  # (vLLM's echo) the last message's text, sent before the reply
    beam: BeamSearchParams | None
    choices: list[Choice]
    replies: list[ReplyReader]
    stream: AsyncIterator[tuple[int, StepUpdate]]  # (closing it aborts whatever is unfinished)
    first: object  # the stream's first item, taken as the turn began (NOT_BEGUN: by begin, later)
    hidden: bool  # thoughts left out: so are log-probabilities and token ids, which would name their tokens
    plain: bool  # no parser reads the reply (no tools, no reasoning)
    echo_top: int | None = None  # (an unstreamed echo) the prompt log-probabilities' alternatives it asked for

    async def begin(self) -> None:
        """Take the stream's first item, where the turn was made without it (an engine's refusal raises here)."""
        if self.first is NOT_BEGUN:
            self.first = await submitted(self.stream)

    def updates(self) -> AsyncIterator[tuple[int, StepUpdate]]:
        if self.first is NOT_BEGUN:
            raise RuntimeError("the turn has not begun: await begin() first")
        return chained(self.first, self.stream)

    def cached_tokens(self) -> int:
        """The prompt tokens read from the prefix cache, as the first update (taken as the turn began) tells them,
        before any update is applied."""
        return 0 if self.first is _END else self.first[1].cached_tokens or 0

    def apply(self, u: StepUpdate) -> tuple[Choice, Delta, str | None]:
        """Fold an update into its choice; returns the choice, what the update adds to its reply (reasoning, content,
        tool calls) and the finish reason the reply reports (where the update ends it)."""
        c, reply = self.choices[u.sample_index].add(u), self.replies[u.sample_index]
        added = reply.feed(u.text)
        finish_reason = None
        if u.finish_reason is not None:
            rest, finish_reason = reply.finish(u.finish_reason)
            added = added + rest
        return c, added, finish_reason
