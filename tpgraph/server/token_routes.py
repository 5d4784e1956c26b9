"""vLLM's /tokenize, /detokenize and /tokenizer_info: a client counts a prompt's tokens (chat messages through the
template, as /v1/chat/completions renders them), turns ids back into text, or learns the special tokens and the chat
template, with the server's own tokenizer. lm-eval's `local-completions` finds these and then needs no tokenizer of
its own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter

from tpgraph.errors import RequestError
from tpgraph.prompts import PromptCodec
from tpgraph.server.protocol import DetokenizeRequest, TokenizeRequest, request_template, template_messages
from tpgraph.server.tools import check_tools, template_tools

TOKENIZE_MAX_CHARS = 4_000_000  # a long book; tokenizing it takes seconds on a thread, not the event loop


def token_routes(prompts: PromptCodec, check_model: Callable[[str | None], None], max_model_len: int,
                 template_variables: Callable[[dict | None], dict | None] = lambda given: given,
                 content_format: str = "auto", trust_request_template: bool = False) -> APIRouter:
    """template_variables: a chat's template variables as the chat route renders them (the server's defaults under
    the request's), so that a count here is the chat's; content_format: the server's chat_template_content_format;
    trust_request_template: a request's own chat_template renders its messages (--trust-request-chat-template)."""
    router = APIRouter()
    vocab = prompts.tokenizer.get_vocab_size(with_added_tokens=True)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if body.messages is not None:
            template = request_template(body.chat_template, body.chat_template_kwargs, trust_request_template,
                                        prompts.special_tokens)
            if body.tools is not None:
                check_tools(body.tools)
            # (as the chat route's, so the counts agree: [] too, as vLLM's)
            tools = None if body.tools is None else template_tools(body.tools)
            messages = template_messages(body.messages, prompts.content_format(tools, content_format, template))
            text = await asyncio.to_thread(prompts.render_chat, messages, body.add_generation_prompt, tools,
                                           template_variables(body.chat_template_kwargs), body.continue_final_message,
                                           template)
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        # (not capped at max_model_len tokens: an evaluation tokenizes whole documents here and windows them itself)
        if len(text) > TOKENIZE_MAX_CHARS:
            raise RequestError(f"the text has {len(text)} characters; /tokenize takes at most {TOKENIZE_MAX_CHARS}")

        def encoded() -> tuple[list[int], list[str] | None]:
            ids = prompts.encode_text(text, special)
            return ids, [prompts.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None

        ids, strs = await asyncio.to_thread(encoded)  # (off the event loop, as completions do: a whole document's)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return prompts.tokenizer_info(max_model_len)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise RequestError(f"tokens must be ids in [0, {vocab}) (the tokenizer's vocabulary), got {bad[:8]}")
        return {"prompt": await asyncio.to_thread(prompts.decode, body.tokens)}  # (off the event loop, as /tokenize)

    return router
