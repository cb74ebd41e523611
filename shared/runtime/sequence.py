"""A request's token sequence and its progress through one engine."""

from __future__ import annotations

import enum
import time

from shared.wire.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    SWAPPED = enum.auto()  # preempted with its KV copied out: the request left this engine
    FINISHED = enum.auto()


class Sequence:
    """Prompt + generated tokens of one request, and which of them this engine has computed.

    Invariants: ``num_cached_tokens <= num_computed_tokens <= num_tokens``; ``block_table`` holds
    the KV blocks for the first ``len(block_table) * block_size`` positions (filled by
    :class:`~shared.runtime.block_manager.BlockManager`, which also owns ``block_hashes``).
    """

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        num_prompt_tokens: int | None = None,
        arrival_time: float | None = None,
        block_size: int = 16,
        parent_request_id: str | None = None,
        choice_index: int = 0,
    ) -> None:
        if not token_ids:
            raise ValueError(f"sequence {request_id!r} has no tokens")
        # The engine's key for it (scheduler, block manager). A choice of an n > 1 request in
        # decode has a key of its own (shared/engine/inputs.py, choice_key); the client's request
        # id is ``parent_request_id``, and ``choice_index`` which of its choices it is.
        self.request_id = request_id
        self.parent_request_id = request_id if parent_request_id is None else parent_request_id
        self.choice_index = choice_index
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.sampling = sampling
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Only used by ``num_blocks``; the BlockManager stamps its own size on allocation.
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        # When this engine first scheduled it (its wait ended there); None while it never was.
        self.started_at: float | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # Chained content hashes of the leading full blocks, extended lazily by the BlockManager.
        # They depend only on token ids, so they stay valid across preemption and engines.
        self.block_hashes: list[bytes] = []
        # int8 KV with a full-precision window (fp_window.py): the slots holding the model-dtype
        # copy of blocks fp_first_block.. (``slots_per_block`` each, in order).
        self.fp_first_block = 0
        self.fp_blocks: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
