"""An engine's inputs and the sequences each became: what the shell acks when.

An *input* is a work message the engine's shell holds unacked until the engine retires it (a
``PrefillMsg``, a ``HandoffMsg``), named by its request id. Almost every input is one sequence
under that same name. A request with ``n`` > 1 (parallel sampling) is one sequence in prefill,
which samples each choice's first token from the one prompt; in decode its handoff becomes one
sequence per choice, all forked from the prompt's KV (shared/engine/decode.py), each named by
:func:`choice_key`, and the input is retired when the last of them is done or has left. A choice
that leaves a decode worker (swapped out) travels on alone, an input of its own named by its
choice key.
"""

from __future__ import annotations


def choice_key(request_id: str, index: int) -> str:
    """The engine's name for choice ``index`` of an n > 1 request. A client's request id may hold
    any character; the NUL keeps choice keys apart from other requests' ids unless a client
    makes an id that mimics another request's choice, which is no worse than reusing its id."""
    return f"{request_id}\x00{index}"


class InputTable:
    """Input key → its sequences' keys, sequence key → its input, request id → its inputs."""

    def __init__(self) -> None:
        self._sequences: dict[str, set[str]] = {}
        self._input_of: dict[str, str] = {}
        self._of_request: dict[str, set[str]] = {}
        self._request_of: dict[str, str] = {}

    def __contains__(self, input_key: str) -> bool:
        return input_key in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, input_key: str, request_id: str, seq_key: str) -> None:
        """A new input, its first sequence ``seq_key``."""
        self._sequences[input_key] = {seq_key}
        self._input_of[seq_key] = input_key
        self._of_request.setdefault(request_id, set()).add(input_key)
        self._request_of[input_key] = request_id

    def join(self, seq_key: str, input_key: str) -> None:
        """Another sequence of ``input_key`` (a choice forked from its first)."""
        self._sequences[input_key].add(seq_key)
        self._input_of[seq_key] = input_key

    def input_of(self, seq_key: str) -> str:
        return self._input_of[seq_key]

    def sequences(self, input_key: str) -> list[str]:
        return sorted(self._sequences.get(input_key, ()))

    def of_request(self, request_id: str) -> list[str]:
        """The inputs of ``request_id`` here (several only for choices that travel alone)."""
        return sorted(self._of_request.get(request_id, ()))

    def leave(self, seq_key: str) -> str | None:
        """``seq_key`` is no longer here. Returns its input if that has no sequence left (the
        input is then forgotten: the shell may ack it)."""
        input_key = self._input_of.pop(seq_key, None)
        if input_key is None:
            return None
        left = self._sequences[input_key]
        left.discard(seq_key)
        if left:
            return None
        del self._sequences[input_key]
        request_id = self._request_of.pop(input_key)
        inputs = self._of_request[request_id]
        inputs.discard(input_key)
        if not inputs:
            del self._of_request[request_id]
        return input_key
