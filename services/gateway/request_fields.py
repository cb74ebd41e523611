"""Which OpenAI and vLLM request fields the gateway honours, refuses or ignores: one table.

api_requests.py maps the honoured ones and refuses the rest when a client sets them to anything
but their default; docs/gateway.md's field table says the same in words, and a test checks that
it names every field listed here. A field that would change what the answer means is never
silently ignored: only those with no effect on the output (``user``, ``store``, ...) are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Sampling fields passed to Baton under the same name, with the type the gateway checks (the
# tokenizer service checks ranges). top_k: -1 is vLLM's "off", mapped to Baton's 0.
SAMPLING_FIELDS: tuple[tuple[str, type], ...] = (
    ("temperature", float),
    ("top_p", float),
    ("top_k", int),
    ("min_p", float),
    ("seed", int),
    ("repetition_penalty", float),
    ("presence_penalty", float),
    ("frequency_penalty", float),
    ("min_tokens", int),
    ("timeout_s", float),
)

Check = Callable[[Any], bool]


def _is_number(value: Any, target: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == target


def _zero(value: Any) -> bool:
    return _is_number(value, 0)


def _false(value: Any) -> bool:
    return value is False


def _true(value: Any) -> bool:
    return value is True


def _never(_value: Any) -> bool:
    """Any value but null asks for something Baton does not do."""
    return False


def _empty(value: Any) -> bool:
    return value in ([], {}, "")


# Fields Baton does not implement, each with the test for "the client left it at its default"
# (null always is).
_BOTH: dict[str, Check] = {
    # OpenAI
    "logit_bias": _empty,
    "tools": _empty,
    "functions": _empty,
    "function_call": lambda v: v in ("none", "auto"),
    "prediction": _never,
    "audio": _never,
    "modalities": lambda v: v == ["text"],
    "web_search_options": _never,
    "reasoning_effort": _never,
    # vLLM
    "use_beam_search": _false,
    "skip_special_tokens": _true,  # Baton's text never holds special tokens
    "spaces_between_special_tokens": _true,
    "truncate_prompt_tokens": _never,
    "allowed_token_ids": _never,
    "bad_words": _empty,
    "guided_json": _never,
    "guided_regex": _never,
    "guided_choice": _never,
    "guided_grammar": _never,
    "structural_tag": _never,
    "logits_processors": _empty,
    "cache_salt": _never,  # the prefix cache is not salted per user: refused, not pretended
    "kv_transfer_params": _empty,
    "vllm_xargs": _empty,
    "mm_processor_kwargs": _empty,
    "prompt_embeds": _never,
}
COMPLETION_OFF: dict[str, Check] = {
    **_BOTH,
    "suffix": lambda v: v == "",
    "add_special_tokens": _true,  # the tokenizer adds them to a prompt text, as HF does
    "top_logprobs": _zero,  # chat's; a completion says how many with logprobs itself
}
CHAT_OFF: dict[str, Check] = {
    **_BOTH,
    "add_special_tokens": _false,  # the chat template places them
    "echo": _false,  # vLLM's: the last message repeated in the answer
    "add_generation_prompt": _true,
    "continue_final_message": _false,
    "documents": _empty,
    "chat_template": _never,
    "chat_template_kwargs": _empty,
}

# Special cases checked in api_requests.py itself (their message says what is allowed).
SPECIAL = ("best_of", "response_format", "tool_choice", "stream_options")

# Accepted and ignored: none of them changes the tokens or the text of the answer.
IGNORED = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "request_id",  # Baton names each request itself (the response's id, X-Request-Id)
    "length_penalty",  # beam search only, which is refused
    "guided_decoding_backend",  # guided decoding only, which is refused
    "guided_whitespace_pattern",
    "include_reasoning",
)

# Honoured beside SAMPLING_FIELDS (api_requests.py maps each one).
HONOURED = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "stream",
    "priority",
    # logprobs.py: completions' logprobs (a count) and echo, chat's logprobs (a flag) and
    # top_logprobs, vLLM's prompt_logprobs and return_tokens_as_token_ids
    "logprobs",
    "top_logprobs",
    "echo",
    "prompt_logprobs",
    "return_tokens_as_token_ids",
    "n",
)
