"""OpenAI (and vLLM) request bodies → the arguments of one Baton request
(``BatonClient.stream_timed``).

Division of labour: this module checks what only the OpenAI dialect has (``best_of``, batched
prompts, content parts, ``stream_options``; ``logprobs`` and ``echo`` in logprobs.py) and the
*types* of the fields it renames or needs itself, so a mistake names the field the client
actually sent. Ranges and limits (``max_tokens`` ≤ the limit, ``top_p`` in (0, 1], penalties'
ranges, ``logprobs`` ≤ 20, stop-string counts, ``n`` ≤ ``BATON_MAX_N``, prompt length, token
ids inside the vocabulary) are left to the tokenizer service, the one authority on them; its
``invalid_request`` replies come back as 400s all the same. A field Baton does not implement is
refused with a 400 naming it unless the client left it at its default (request_fields.py lists
them; docs/gateway.md has the whole table).

Defaults follow OpenAI, not Baton's contract, where the two differ: ``temperature`` 1.0 (or the
model's ``generation_config.json`` values for ``temperature`` / ``top_p`` / ``top_k``, as in vLLM:
sampling_defaults.py), and a chat completion without ``max_tokens`` runs until EOS, a stop
string or the model's length (``Limits.max_model_len``, capped by ``max_tokens_limit``; the
tokenizer clamps it to what fits after the prompt); a completion's default stays 16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from services.gateway.errors import ApiError, invalid
from services.gateway.logprobs import ResponseOptions, baton_fields, parse_options
from services.gateway.request_fields import CHAT_OFF, COMPLETION_OFF, SAMPLING_FIELDS
from services.gateway.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from shared.config import BatonConfig
from shared.limits import Limits
from shared.models.catalog import served_model_id
from shared.wire.errors import ProtocolError
from shared.wire.priority import check_priority
from shared.wire.sampling import DEFAULT_MAX_TOKENS

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


@dataclass(frozen=True)
class BatonRequest:
    """One validated OpenAI request, ready to publish."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    baton: dict[str, Any]  # keyword arguments of BatonClient.stream_timed
    options: ResponseOptions = ResponseOptions()  # logprobs, echo (logprobs.py)
    echo_text: str | None = None  # the prompt's text, when echoed (None: not known yet)

    @property
    def timeout_s(self) -> float | None:
        value = self.baton.get("timeout_s")
        return float(value) if value is not None else None

    @property
    def n(self) -> int:
        """Choices asked for: one done reply (and one OpenAI choice) each."""
        return int(self.baton.get("n", 1))


def parse_completion(
    body: Any, config: BatonConfig, defaults: SamplingDefaults = OPENAI_DEFAULTS
) -> BatonRequest:
    body = _object(body)
    _refuse_unsupported(body, chat=False)
    baton = _prompt(body.get("prompt"))
    max_tokens = _opt(body, "max_tokens", int)
    # Baton's default is OpenAI's documented one for /v1/completions: 16.
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    # vLLM's echo without generation (lm-evaluation-harness's log-likelihood requests): one
    # token is generated (Baton's minimum) and left out of the answer. Without echo, 0 is the
    # tokenizer's to refuse, as vLLM refuses it.
    echo_only = max_tokens == 0 and body.get("echo") is True
    baton["max_tokens"] = 1 if echo_only else max_tokens
    req = _finish(body, config, baton, defaults, chat=False)
    if req.options.echo:
        options = replace(req.options, echo_only=echo_only)
        req = replace(req, options=options, echo_text=baton.get("prompt"))
    return req


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one: OpenAI's ["text"] or [[ids]]
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(t, (str, list)) for t in prompt)
    ):
        raise invalid(
            f"prompt holds {len(prompt)} prompts; this server takes one prompt per request "
            "(send one request per prompt)",
            "prompt",
        )
    if isinstance(prompt, str):
        return {"prompt": text_of(prompt, "prompt")}
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise invalid("prompt must be a string or a list of token ids", "prompt")


def parse_chat(
    body: Any,
    config: BatonConfig,
    limits: Limits,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> BatonRequest:
    body = _object(body)
    _refuse_unsupported(body, chat=True)
    baton: dict[str, Any] = {"messages": messages_of(body.get("messages"))}
    # max_completion_tokens is OpenAI's current name; max_tokens its deprecated alias.
    max_tokens = _opt(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", int)
    if max_tokens is None:
        max_tokens = min(limits.max_model_len, config.max_tokens_limit)
    baton["max_tokens"] = max_tokens
    return _finish(body, config, baton, defaults, chat=True)


def _finish(
    body: dict[str, Any],
    config: BatonConfig,
    baton: dict[str, Any],
    defaults: SamplingDefaults,
    chat: bool,
) -> BatonRequest:
    served = check_model(body, config)
    stream = bool(_opt(body, "stream", bool))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    include_usage = bool(_opt(options or {}, "include_usage", bool))
    if _opt(options or {}, "continuous_usage_stats", bool):
        raise invalid("stream_options.continuous_usage_stats is not supported by this server",
                      "stream_options")  # fmt: skip

    baton.update(defaults.fields())
    for name, kind in SAMPLING_FIELDS:
        value = _opt(body, name, kind)
        if value is not None:
            baton[name] = value
    if baton.get("top_k") == -1:  # vLLM's spelling of "off"; Baton's is 0
        baton["top_k"] = 0
    for flag in ("ignore_eos", "include_stop_str_in_output"):
        if _opt(body, flag, bool):
            baton[flag] = True
    options = parse_options(body, chat, stream)
    baton.update(baton_fields(options))
    n = _opt(body, "n", int)
    if n is not None and n != 1:  # its range is the tokenizer's (BATON_MAX_N)
        baton["n"] = n
    baton["stop"] = _stop(body.get("stop"))
    stop_token_ids = token_ids_of(body.get("stop_token_ids"), "stop_token_ids")
    if stop_token_ids:
        baton["stop_token_ids"] = stop_token_ids
    priority = _opt(body, "priority", int)
    if priority is not None:
        # Checked here, not only by the tokenizer: it also becomes the AMQP message priority.
        try:
            baton["priority"] = check_priority(priority)
        except ProtocolError as exc:
            raise invalid(exc.message, "priority") from None
    return BatonRequest(chat, served, stream, include_usage, baton, options)


def check_model(body: dict[str, Any], config: BatonConfig) -> str:
    """The served model id; a body naming another model is a 404, as OpenAI's."""
    model = body.get("model")
    served = served_model_id(config)
    if model is not None and model != served:
        raise ApiError(
            404, f"the model {_short(model)} does not exist; this server serves {served!r}",
            "invalid_request_error", "model_not_found", "model",
        )  # fmt: skip
    return served


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Fields that would change the answer's meaning are refused, never silently ignored."""
    n, best_of = body.get("n"), body.get("best_of")
    if best_of is not None and best_of != (1 if n is None else n):
        raise invalid(
            f"best_of must equal n (got best_of={_short(best_of)}, n={_short(n)}): this server "
            "returns every choice it samples, it does not rank them",
            "best_of",
        )
    for name, is_default in (CHAT_OFF if chat else COMPLETION_OFF).items():
        value = body.get(name)
        if value is not None and not is_default(value):
            raise invalid(f"{name} is not supported by this server (got {_short(value)})", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("response_format other than {'type': 'text'} is not supported",
                      "response_format")  # fmt: skip
    if chat and body.get("tool_choice") not in (None, "none", "auto"):
        raise invalid("tool_choice is not supported by this server", "tool_choice")


def messages_of(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if content is None:  # an assistant turn that only called tools
            content = ""
        elif isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise invalid(
                        f"messages[{i}].content: only text parts are supported", "messages"
                    )
                if not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content: a text part needs a string text",
                                  "messages")  # fmt: skip
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of parts",
                          "messages")  # fmt: skip
        role = text_of(m["role"], "messages")
        out.append({"role": role, "content": text_of(content, "messages")})
    return out


def token_ids_of(value: Any, param: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return value
    raise invalid(f"{param} must be a list of integers", param)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [text_of(value, "stop")]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [text_of(s, "stop") for s in value]
    raise invalid("stop must be a string or a list of strings", "stop")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(value: Any) -> bool:
    """An integer the wire (msgpack: signed or unsigned 64-bit) can carry; bool is none."""
    return isinstance(value, int) and not isinstance(value, bool) and _INT_MIN <= value <= _INT_MAX


def text_of(value: str, param: str) -> str:
    """JSON admits lone surrogates ("\\ud800"), which no UTF-8 encoder (msgpack's) takes."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise invalid(f"{param} holds text that is not valid Unicode", param) from None
    return value


def _opt(body: dict[str, Any], name: str, kind: type) -> Any:
    """``body[name]`` if present and not null, checked to be a ``kind`` (bool is no number)."""
    value = body.get(name)
    if value is None:
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = _is_int(value)
    else:  # float: an integer is a number too, if a float can hold it
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (isinstance(value, float) or _INT_MIN <= value <= _INT_MAX)
    if not ok:
        if isinstance(value, int) and not isinstance(value, bool):
            raise invalid(f"{name} is out of range (beyond 64 bits)", name)
        raise invalid(f"{name} must be {_NAMES[kind]}, got {type(value).__name__}", name)
    return float(value) if kind is float else value


_NAMES = {bool: "a boolean", int: "an integer", float: "a number"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
