"""Incremental detokenization with exact stop-string cuts.

Byte-level BPE splits multi-byte UTF-8 characters across tokens, so decoding one token at a time
yields U+FFFD halves. We decode a short window ``ids[prefix_offset:]`` and emit only text that is
stable (does not end in U+FFFD); the window restarts at the last stable boundary, so each step
costs O(window), not O(output). At finish, whatever is still held back is flushed from a full
decode, so the streamed deltas always add up to the final text.

Stop strings: text that could still become the start of a stop string is held back from the
stream, so a client never sees characters that the final text will cut. The text ends right
before the first stop string found, or right after it with ``include_stop`` (vLLM's
``include_stop_str_in_output``). A token that ended
the sequence in the engine (EOS, a ``stop_token_ids`` entry) may be added ``hidden``: it counts
as an output token but adds no text, as in vLLM.

Nothing to stream and no stop string to find (``lazy``): the text is only needed at the end, so
``add`` just keeps the ids and ``finish`` decodes them once. Under a flood of non-streaming
requests this was most of the detokenizer's work (two decodes per request per step), and every
other request's replies waited behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: Decode,
        stop: Sequence[str] = (),
        lazy: bool = False,
        include_stop: bool = False,
    ) -> None:
        self._decode = decode
        self.stop = tuple(stop)
        self.include_stop = include_stop
        if lazy and self.stop:
            raise ValueError("stop strings are found as the text grows: not lazily")
        self.lazy = lazy
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # stable text decoded so far (cut at a stop string once one is found)
        self._prefix_offset = 0
        self._read_offset = 0
        self._streamed = 0  # characters of self.text already handed out as deltas
        self.stopped = False  # a stop string was found; self.text ends at it
        self.stop_string: str | None = None  # which one
        self._hidden = 0  # trailing token ids that add no text (hide_last)

    def add(self, token_ids: Sequence[int], hide_last: bool = False) -> None:
        """Append tokens (the last one without its text if ``hide_last``: the sequence ends
        with it); afterwards :meth:`take_delta` returns what may be streamed."""
        if self.stopped:
            return
        self.token_ids.extend(token_ids)
        if hide_last and token_ids:
            self._hidden = 1
        if self.lazy:
            return
        ids = self.token_ids
        end = len(ids) - self._hidden
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset : end])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._append_text(new_text[len(prefix_text) :])
            self._prefix_offset = self._read_offset
            self._read_offset = end

    def finish(self) -> None:
        """No more tokens: flush text held back for incomplete characters."""
        if self.stopped:
            return
        full = self._decode(self.token_ids[: len(self.token_ids) - self._hidden])
        if full.startswith(self.text):
            self._append_text(full[len(self.text) :])
        self._holdback = 0

    @property
    def num_streamed_chars(self) -> int:
        """Characters of the text handed out so far: the offset of the next delta."""
        return self._streamed

    def skip_streamed(self, num_chars: int) -> None:
        """The first ``num_chars`` characters were handed out already (by the instance this one
        replays): the next delta starts after them."""
        self._streamed = max(self._streamed, num_chars)

    def take_delta(self, final: bool = False) -> str:
        """Text not yet streamed; keeps back a possible stop-string prefix unless ``final``."""
        limit = len(self.text) if (final or self.stopped) else len(self.text) - self._holdback
        if limit <= self._streamed:
            return ""
        delta = self.text[self._streamed : limit]
        self._streamed = limit
        return delta

    def _append_text(self, delta: str) -> None:
        if not delta:
            return
        start = max(0, len(self.text) - self._holdback)
        self.text += delta
        if not self.stop:
            return
        # Only the new text and the holdback before it can contain a stop string not seen yet.
        window = self.text[start:]
        found = [(i, s) for i, s in ((window.find(s), s) for s in self.stop) if i >= 0]
        if found:
            cut, stop = min(found, key=lambda f: f[0])  # the first; a tie: the first listed
            self.text = self.text[: start + cut + (len(stop) if self.include_stop else 0)]
            self.stopped = True
            self.stop_string = stop
