"""Baton replies → OpenAI response objects and server-sent events.

Streams follow OpenAI's chunk format: ``text_completion`` objects for /v1/completions and
``chat.completion.chunk`` objects for chat (the first chat chunk carries ``role: assistant``),
the last content-bearing chunk is followed by one with ``finish_reason``, then, when
``stream_options.include_usage`` asked for it, a chunk with ``usage`` and empty ``choices``
(every other chunk then carries ``"usage": null``, as OpenAI's do), then ``data: [DONE]``.

Logprobs and echo take OpenAI's and vLLM's shapes (logprobs.py); every choice carries vLLM's
``stop_reason`` (a stream's, its finish chunk).

Finish reasons: Baton's ``stop`` and ``length`` pass through. ``timeout`` (the request's
``timeout_s`` ran out after some tokens) becomes ``length``: the output was cut by a budget the
client set, which is what ``length`` tells a client. ``cancelled`` (someone published a cancel
for the request; a client that disconnected gets no response at all) becomes ``abort``, vLLM's
value for a request ended from outside.
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.gateway.errors import ApiError
from services.gateway.logprobs import LogprobsFormat, ResponseOptions
from shared.wire.messages import DoneReply

FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length", "cancelled": "abort"}
DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",  # a proxy in front (nginx) must not hold the stream back
}


def finish_reason(baton_reason: str) -> str:
    return FINISH_REASONS.get(baton_reason, baton_reason)


def usage(done: DoneReply) -> dict[str, int]:
    prompt = int(done.usage.get("prompt_tokens", 0))
    completion = int(done.usage.get("completion_tokens", len(done.token_ids)))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class Formatter:
    """The OpenAI objects of one request (one id, one ``created`` stamp, one model)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        include_usage: bool = False,
        options: ResponseOptions | None = None,
        echo_text: str = "",
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.options = options = options or ResponseOptions()
        self.echo_text = echo_text  # completions' echo: the prompt's text
        self.created = int(time.time())
        self._stream_logprobs = LogprobsFormat(options)  # a stream's text_offset runs on

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    # --- non-streaming ----------------------------------------------------------------------
    def completion(self, done: DoneReply) -> dict[str, Any]:
        reason = finish_reason(done.finish_reason)
        opts, lp = self.options, LogprobsFormat(self.options)
        asked = opts.logprobs is not None
        if self.chat:
            out = self._envelope("chat.completion")
            message = {"role": "assistant", "content": done.text}
            logprobs = lp.chat(done.logprobs or []) if asked else None
            choice = {"index": 0, "message": message, "logprobs": logprobs}
            if opts.prompt_logprobs is not None:  # vLLM's place for chat: the response's
                out["prompt_logprobs"] = lp.prompt(done.prompt_logprobs)
        else:
            out = self._envelope("text_completion")
            text, entries = done.text, done.logprobs or []
            if opts.echo:
                prompt = done.prompt_logprobs or []
                text = self.echo_text + ("" if opts.echo_only else text)
                entries = prompt + ([] if opts.echo_only else entries)
            choice = {
                "index": 0,
                "text": text,
                "logprobs": lp.completion(entries) if asked else None,
            }
        choice.update(finish_reason=reason, stop_reason=done.stop_reason)
        if opts.prompt_logprobs is not None and not self.chat:  # vLLM's: the choice's
            choice["prompt_logprobs"] = lp.prompt(done.prompt_logprobs)
        out["choices"] = [choice]
        out["usage"] = usage(done)
        return out

    # --- streaming --------------------------------------------------------------------------
    def chunk(
        self,
        text: str | None = None,
        reason: str | None = None,
        role: bool = False,
        logprobs: list[list[Any]] | None = None,
        stop_reason: str | int | None = None,
    ) -> bytes:
        """One SSE event: a text delta (with its tokens' ``logprobs`` entries, if the request
        asked), the opening role (chat), or the finish (``reason``)."""
        scores = None
        if logprobs is not None and self.options.logprobs is not None:
            lp = self._stream_logprobs
            scores = lp.chat(logprobs) if self.chat else lp.completion(logprobs)
        if self.chat:
            out = self._envelope("chat.completion.chunk")
            delta: dict[str, str] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": scores, "finish_reason": reason}
        else:
            out = self._envelope("text_completion")
            choice = {"index": 0, "text": text or "", "logprobs": scores, "finish_reason": reason}
        if reason is not None:
            choice["stop_reason"] = stop_reason
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def finish(self, done: DoneReply) -> bytes:
        """The closing events: finish reason, usage (if asked for), ``[DONE]``."""
        reason = finish_reason(done.finish_reason)
        events = [self.chunk(reason=reason, stop_reason=done.stop_reason)]
        if self.include_usage:
            out = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
            out["choices"] = []
            out["usage"] = usage(done)
            events.append(sse(out))
        events.append(DONE_EVENT)
        return b"".join(events)

    @staticmethod
    def error(err: ApiError) -> bytes:
        """An error after the stream began (the status line is gone): an event with an
        ``error`` member, which the openai client raises as ``APIError``, then ``[DONE]``."""
        return sse(err.body()) + DONE_EVENT
