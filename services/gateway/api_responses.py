"""Baton replies → OpenAI response objects and server-sent events.

Streams follow OpenAI's chunk format: ``text_completion`` objects for /v1/completions and
``chat.completion.chunk`` objects for chat (the first chat chunk carries ``role: assistant``),
the last content-bearing chunk is followed by one with ``finish_reason``, then, when
``stream_options.include_usage`` asked for it, a chunk with ``usage`` and empty ``choices``
(every other chunk then carries ``"usage": null``, as OpenAI's do), then ``data: [DONE]``.
With ``n`` > 1 every choice has its own chunks (``choices[0].index``: which), its own opening
role chunk (chat) and finish chunk, in the order Baton's replies come; usage and ``[DONE]``
follow the last choice's finish. Usage counts the prompt once and sums the choices' tokens.

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


def usage(dones: list[DoneReply]) -> dict[str, int]:
    """The prompt once, the completion tokens of every choice."""
    prompt = int(dones[0].usage.get("prompt_tokens", 0))
    completion = sum(int(d.usage.get("completion_tokens", len(d.token_ids))) for d in dones)
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
        self.options = options or ResponseOptions()
        self.echo_text = echo_text  # completions' echo: the prompt's text
        self.created = int(time.time())
        self._stream_logprobs: dict[int, LogprobsFormat] = {}  # by choice: its text_offset

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    # --- non-streaming ----------------------------------------------------------------------
    def completion(self, dones: list[DoneReply]) -> dict[str, Any]:
        """``dones``: each choice's done reply, in choice order (the prompt's logprobs, if
        asked for, come with choice 0's)."""
        out = self._envelope("chat.completion" if self.chat else "text_completion")
        opts = self.options
        asked = opts.logprobs is not None
        prompt = dones[0].prompt_logprobs
        choices = []
        for index, done in enumerate(dones):
            lp = LogprobsFormat(opts)
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": done.text}
                choice["logprobs"] = lp.chat(done.logprobs or []) if asked else None
            else:
                text, entries = done.text, done.logprobs or []
                if opts.echo:
                    text = self.echo_text + ("" if opts.echo_only else text)
                    entries = (prompt or []) + ([] if opts.echo_only else entries)
                choice["text"] = text
                choice["logprobs"] = lp.completion(entries) if asked else None
            choice.update(
                finish_reason=finish_reason(done.finish_reason), stop_reason=done.stop_reason
            )
            if opts.prompt_logprobs is not None and not self.chat:  # vLLM's: the choice's
                choice["prompt_logprobs"] = LogprobsFormat(opts).prompt(prompt)
            choices.append(choice)
        if opts.prompt_logprobs is not None and self.chat:  # vLLM's place for chat: the response's
            out["prompt_logprobs"] = LogprobsFormat(opts).prompt(prompt)
        out["choices"] = choices
        out["usage"] = usage(dones)
        return out

    # --- streaming --------------------------------------------------------------------------
    def chunk(
        self,
        text: str | None = None,
        reason: str | None = None,
        role: bool = False,
        logprobs: list[list[Any]] | None = None,
        stop_reason: str | int | None = None,
        index: int = 0,
    ) -> bytes:
        """One SSE event of choice ``index``: a text delta (with its tokens' ``logprobs``
        entries, if the request asked), the opening role (chat), or the finish (``reason``)."""
        scores = None
        if logprobs is not None and self.options.logprobs is not None:
            lp = self._stream_logprobs.setdefault(index, LogprobsFormat(self.options))
            scores = lp.chat(logprobs) if self.chat else lp.completion(logprobs)
        if self.chat:
            out = self._envelope("chat.completion.chunk")
            delta: dict[str, str] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": scores, "finish_reason": reason}
        else:
            out = self._envelope("text_completion")
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": scores,
                "finish_reason": reason,
            }
        if reason is not None:
            choice["stop_reason"] = stop_reason
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def finish(self, done: DoneReply) -> bytes:
        """The closing events of a one-choice stream: finish reason, usage (if asked for),
        ``[DONE]``."""
        return self.finish_choice(done) + self.close([done])

    def finish_choice(self, done: DoneReply, index: int = 0) -> bytes:
        """Choice ``index`` ends: its finish reason (and vLLM's ``stop_reason``)."""
        reason = finish_reason(done.finish_reason)
        return self.chunk(reason=reason, stop_reason=done.stop_reason, index=index)

    def close(self, dones: list[DoneReply]) -> bytes:
        """After every choice's finish: usage (if asked for), ``[DONE]``."""
        events = []
        if self.include_usage:
            out = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
            out["choices"] = []
            out["usage"] = usage(dones)
            events.append(sse(out))
        events.append(DONE_EVENT)
        return b"".join(events)

    @staticmethod
    def error(err: ApiError) -> bytes:
        """An error after the stream began (the status line is gone): an event with an
        ``error`` member, which the openai client raises as ``APIError``, then ``[DONE]``."""
        return sse(err.body()) + DONE_EVENT
