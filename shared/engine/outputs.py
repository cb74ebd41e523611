"""What goes into an engine, what it tells its shell about itself, and what one ``step`` gives
back. Plain data, no behaviour: a shell reads these and never an engine's parts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.engine.inputs import choice_key
from shared.engine.load import EngineLoad
from shared.kv_transfer.connector import KVConnectorStats
from shared.runtime.logprobs import Entry
from shared.wire.errors import ErrorCode
from shared.wire.messages import KVDescriptor, KVRelease
from shared.wire.sampling import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """What a shell needs to know about its engine, fixed once the engine is built."""

    kind: str  # "prefill" | "decode"
    vocab_size: int  # token ids at or beyond it are refused before they reach a forward
    max_model_len: int  # the longest sequence this engine serves (``Limits``, with its cache)
    weight_bytes: int  # the model's parameters: what every decode step reads
    kv_bytes_per_token: int  # KV cache bytes per token (all layers, K and V)
    release_route: str | None  # a pooled sender's id: receivers' release notices go to its queue
    spill_store: bool  # it hands off through the spill store, whose size the policy watches


@dataclass(frozen=True)
class NewRequest:
    """A request as an engine receives it (the shell translates its wire message into this)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # decode: generated so far (>= 1; none for a layer-wise handoff, whose first token comes
    # with its KV: kv_transfer/layerwise.py)
    output_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    arrival_time: float = 0.0  # wall clock
    deadline: float | None = None  # wall clock; None = no deadline
    kv: KVDescriptor | None = None  # decode: where the prompt's KV waits; None = recompute
    # Parallel sampling (``sampling.n`` > 1), decode. ``choices``: (index, first token) of each
    # choice to fork the prompt's KV into (prefill's handoff; ``output_token_ids`` is empty).
    # ``choice_index``: this is that one choice alone (it was swapped out of a decode worker).
    choices: list[tuple[int, int]] = field(default_factory=list)
    choice_index: int | None = None

    @property
    def input_key(self) -> str:
        """The name its shell holds it under (shared/engine/inputs.py)."""
        if self.choice_index is None:
            return self.request_id
        return choice_key(self.request_id, self.choice_index)

    @property
    def first_choice(self) -> int:
        """The choice its first sequence is (0 for a request with n = 1)."""
        if self.choices:
            return self.choices[0][0]
        return self.choice_index or 0

    @property
    def sequence_key(self) -> str:
        """Its first sequence's name: a choice's key when it is (or forks into) choices."""
        if self.choices or self.choice_index is not None:
            return choice_key(self.request_id, self.first_choice)
        return self.request_id

    @property
    def token_ids(self) -> list[int]:
        """Its first sequence's tokens: the prompt and the output so far (that choice's)."""
        if self.choices:
            return self.prompt_token_ids + [self.choices[0][1]]
        return self.prompt_token_ids + self.output_token_ids


class AddResult(enum.Enum):
    ADDED = enum.auto()  # the engine owns the request until it shows up in ``retired``
    DUPLICATE = enum.auto()  # already here (a redelivery): drop this copy
    STALE = enum.auto()  # cancelled or past its deadline: drop it (the detokenizer answers)
    TOO_LONG = enum.auto()  # can never fit this engine: answer ``prompt_too_long``


@dataclass(frozen=True)
class TokenOutput:
    """New tokens of one request at output positions ``[index, index + len(token_ids))``."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" when this ends the request (choice)
    scheduled_at: float | None = None  # prefill: wall clock when its batch started
    choice_index: int = 0  # which choice of an n > 1 request
    # Asked for by the request (shared/runtime/logprobs.py's entries): one per token, and
    # prefill's one per prompt token (the first unscored: logprob and rank None).
    logprobs: list[Entry] | None = None
    prompt_logprobs: list[Entry] | None = None


@dataclass(frozen=True)
class Handoff:
    """Prefill → decode: a finished prompt, its first token(s) and where its KV waits."""

    request_id: str
    output_token_ids: list[int]
    kv: KVDescriptor | None  # None: the transport could not take it; decode recomputes
    priority: int = 0  # the AMQP priority of the handoff: the effective priority when it left
    # Parallel sampling: as in NewRequest (the choices to fork into; or one choice alone).
    choices: list[tuple[int, int]] = field(default_factory=list)
    choice_index: int | None = None
    input_key: str = ""  # the input it leaves from (the shell's name for it); "": request_id


@dataclass(frozen=True)
class RequestError:
    request_id: str
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class KVTransferStat:
    transport: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class StepStats:
    """Facts about one forward, for metrics. Cumulative counters are running totals."""

    num_seqs: int
    num_scheduled_tokens: int
    num_generated_tokens: int
    num_context_tokens: int  # KV tokens the forward read (decode bandwidth)
    forward_s: float
    prefix_queries_total: int
    prefix_hits_total: int
    preemptions_total: int  # by recompute
    swaps_out_total: int = 0  # preemptions by swap (decode)
    swaps_in_total: int = 0  # sequences resumed from swapped-out KV (decode)
    # decode: preemptions (swap or recompute) by cause: priority_slot | priority_kv | kv_full
    preemptions_by_cause: dict[str, int] = field(default_factory=dict)
    prefetch_hits_total: int = 0  # decode: resumed KV that landed before the step needing it
    num_threads: int = 1  # torch's intra-op threads in the step's thread (the cores it used)


@dataclass
class StepOutput:
    """Everything one ``step`` produced. The shell publishes ``tokens``, ``handoffs``, ``errors``
    and ``releases``, and only once those are confirmed acks the inputs of ``retired``."""

    tokens: list[TokenOutput] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)  # inputs this engine is done with
    releases: list[KVRelease] = field(default_factory=list)  # receiver → sender notices
    transfers: list[KVTransferStat] = field(default_factory=list)
    stats: StepStats | None = None  # None when no forward ran
    load: EngineLoad = field(default_factory=EngineLoad)  # set by every step
    kv: KVConnectorStats = field(default_factory=KVConnectorStats)  # the connector's, every step
    # Orphaned KV the engine's connectors reclaimed, cumulative, by (kind, reason).
    kv_reclaimed: dict[tuple[str, str], int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.handoffs or self.errors or self.retired or self.releases)
