"""What turns a user's prompt into token ids, and back: the tokenizer, the chat template and the checkpoint's
generation defaults. TPEngine holds one; the server's front-end process gets a pickled copy, so it tokenizes and
renders without touching the engine process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from tpgraph.chat import ChatTemplate, GenerationDefaults
from tpgraph.engine.sampling_params import SamplingParams
from tpgraph.errors import RequestError

Prompt = str | list[int] | list[dict[str, str]]


@dataclass
class PromptCodec:
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    generation_defaults: GenerationDefaults
    model_label: str  # names the checkpoint in messages

    def encode(self, prompt: Prompt) -> list[int]:
        """Text (BOS added as the tokenizer does), token ids as they are, or chat messages through the template."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode(self.render_chat(prompt), add_special_tokens=False).ids
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise RequestError(f"a prompt is a string, a list of token ids or a list of chat messages, got "
                           f"{type(prompt).__name__}")

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise RequestError(f"{self.model_label} has no chat template (chat_template.jinja, or "
                               f"tokenizer_config.json's chat_template); send a plain prompt")
        return self.chat_template.render(messages, add_generation_prompt)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config defaults, then `overrides`."""
        return SamplingParams(**{**self.generation_defaults.sampling, **overrides})

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id], skip_special_tokens=False)
