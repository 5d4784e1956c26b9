"""What a request must satisfy before the engine takes it. Plain values, so the server's front-end process checks
requests itself (a refused one is a 400 before anything reaches the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from tpgraph.engine.sampling_params import MAX_LOGPROBS, SamplingParams, held_before_min_tokens
from tpgraph.errors import RequestError


def kept_prompt_tokens(truncate_prompt_tokens: int | None, max_model_len: int, max_tokens: int | None) -> int | None:
    """vLLM's truncate_prompt_tokens: how many of the prompt's last tokens to keep (None: all, and a prompt too long is
    refused), within what max_tokens leaves of max_model_len, as vLLM's TokenizeParams reads it (the server passes the
    request's max_tokens; LLM.generate none, so offline it is max_model_len). -1: all that leaves, max_model_len where
    max_tokens is None (a prompt cut to that leaves no room to generate, and is refused, as vLLM refuses it); a k past
    it is refused whatever the prompt's length, as vLLM's is."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    room = max_model_len - max(max_tokens or 0, 0)
    if room < 1:
        raise RequestError(f"max_tokens {max_tokens} leaves no room in max_model_len {max_model_len} for a prompt, "
                           f"however truncate_prompt_tokens cuts it")
    if k == -1:
        return room
    if not 1 <= k <= room:
        of = f"max_model_len {max_model_len} less max_tokens {max_tokens}" if max_tokens else "max_model_len"
        raise RequestError(f"truncate_prompt_tokens must be between 1 and {room} ({of}), or -1 (all of that), "
                           f"got {k}")
    return k


def check_params_type(params: object) -> None:
    """A request's sampling parameters must be a SamplingParams: anything else (a dict, say) is refused naming the
    type, before any of its fields is read (an AttributeError from deep inside otherwise)."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling parameters must be a SamplingParams, got {type(params).__name__}")


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    cache_tokens: int  # what the whole KV cache holds
    priority_scheduling: bool = False  # (else a request's priority must be 0, as vLLM's server refuses others)
    eos_ids: tuple[int, ...] = ()  # (min_tokens holds them back, with stop_token_ids)
    max_logprobs: int = MAX_LOGPROBS  # (vLLM's --max-logprobs: a request asking more alternatives a token is refused)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the engine would refuse this prompt."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.vocab_size
        bad = next((i for i, t in enumerate(prompt_ids)
                    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:  # (named, as vLLM's "Token id N is out of vocabulary": one of thousands is hard to find)
            raise RequestError(f"prompt token ids must be integers in [0, {vocab}), got {prompt_ids[bad]!r} at "
                               f"position {bad}")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}, "
                               f"which leaves no room to generate")
        if len(prompt_ids) > self.cache_tokens:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {self.cache_tokens}")
        check_params_type(params)
        if len(prompt_ids) + params.min_tokens > self.max_model_len:  # (unbounded where max_tokens is None)
            raise RequestError(f"min_tokens {params.min_tokens} cannot be met: with the prompt's {len(prompt_ids)} "
                               f"tokens that passes max_model_len {self.max_model_len}")
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > self.max_model_len:
            # refused, not cut short: a client that asked for more than fits would otherwise get less without asking
            raise RequestError(f"max_model_len is {self.max_model_len} tokens, and this request asks for "
                               f"{len(prompt_ids) + params.max_tokens}: {len(prompt_ids)} in the prompt and "
                               f"{params.max_tokens} to generate; ask for at most "
                               f"{self.max_model_len - len(prompt_ids)} new tokens, or for none (null) to generate "
                               f"up to max_model_len")
        for what, asked in (("logprobs (a chat's top_logprobs)", params.logprobs),
                            ("prompt_logprobs (a completion's logprobs with echo)", params.prompt_logprobs)):
            if asked is not None and asked > self.max_logprobs:
                raise RequestError(f"{what} asks for {asked} log-probabilities a token, more than the "
                                   f"{self.max_logprobs} this server returns (its max_logprobs)")
            if asked is not None and asked > vocab:  # (the step's top-k over the vocabulary would fail the batch)
                raise RequestError(f"{what} asks for {asked} log-probabilities a token, more than the model's "
                                   f"vocabulary of {vocab} tokens")
        if any(t >= vocab for t in params.stop_token_ids):  # (they index the logits: an id past them fails the step)
            raise RequestError(f"stop_token_ids must be below the vocabulary size {vocab}, got "
                               f"{[t for t in params.stop_token_ids if t >= vocab]}")
        if params.priority and not self.priority_scheduling:
            raise RequestError(f"priority {params.priority} needs a server started with --scheduling-policy priority "
                               f"(an engine with scheduling_policy='priority'; this one serves first come first "
                               f"served)")
        if params.allowed_token_ids is not None and params.allowed_token_ids[-1] >= vocab:
            raise RequestError(f"allowed_token_ids must be below the vocabulary size {vocab}, got "
                               f"{[t for t in params.allowed_token_ids if t >= vocab]}")
        if params.allowed_token_ids is not None and params.min_tokens and set(params.allowed_token_ids) <= (
                held_before_min_tokens(params, self.eos_ids)):
            # (every logit of its first rows would be masked, and their argmax, id 0, is not allowed)
            raise RequestError(f"allowed_token_ids {list(params.allowed_token_ids)} are all stop tokens, which "
                               f"min_tokens {params.min_tokens} holds back: no token is left to generate before it")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be below the vocabulary size {vocab}, got "
                               f"{[t for t, _ in params.logit_bias if t >= vocab]}")
