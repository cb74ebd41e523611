"""Shared by the engine, core and parity tests: tiny models, the production engines wired into
a prefill/decode pair (plumbing only), and the Hugging Face reference."""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from shared.config import REPO_ROOT, BatonConfig
from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.decode import DecodeEngine
from shared.engine.engine import EngineCore
from shared.engine.outputs import (
    AddResult,
    Handoff,
    KVTransferStat,
    NewRequest,
    RequestError,
    StepOutput,
)
from shared.engine.prefill import PrefillEngine
from shared.models.tiny.builder import ensure_tiny_model, model_dir_name
from shared.runtime import ModelRunner, SamplingParams, Sequence
from shared.runtime.kv_codec import KVCodec
from shared.runtime.logprobs import Entry, StepLogprobs

MODELS_DIR = REPO_ROOT / "models"


K = TypeVar("K")


def built_or_skip(kernel: K | None, fallback: str) -> K:
    """A native kernel's test module needs the kernel: skipped without a C compiler (the
    ``fallback`` that serves then is tested elsewhere)."""
    if kernel is None:
        pytest.skip(f"no C compiler: {fallback} serves (tested elsewhere)")
    return kernel


def tiny_model_dir(arch: str, preset: str = "tiny", window: int | None = None) -> Path:
    """The built-in model for (preset, arch[, sliding window]), built once into the git-ignored
    models/ folder (tiny llama is the default model dir itself)."""
    name = model_dir_name(preset, arch, window)
    return ensure_tiny_model(MODELS_DIR / name, preset=preset, arch=arch, window=window)


def make_runner(model_dir: Path, num_kv_blocks: int = 256, **overrides: object) -> ModelRunner:
    config = BatonConfig(model=str(model_dir), num_kv_blocks=num_kv_blocks, **overrides)  # type: ignore[arg-type]
    return ModelRunner(config)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """The tiny models gain nothing from threads, and on a busy 2-core box OpenMP spinning makes
    HF generate ~10x slower; restored afterwards so other tests see the defaults."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ForwardLog:
    """A spy on one ModelRunner: what its engine asked it to compute, call by call."""

    def __init__(self, runner: ModelRunner) -> None:
        # Per prefill call: (request_id, first position, tokens computed, prefix-hit tokens).
        self.prefills: list[list[tuple[str, int, int, int]]] = []
        self.decodes: list[list[str]] = []  # per decode call: the request ids
        prefill, decode = runner.prefill_choices, runner.decode

        def spy_prefill(  # every prefill forward (``prefill`` calls it too)
            seqs: list[Sequence],
            num_new_tokens: list[int],
            on_layer: Callable[[int], None] | None = None,
            logprobs: StepLogprobs | None = None,
        ) -> list[list[int] | None]:
            self.prefills.append(
                [
                    (s.request_id, s.num_computed_tokens, n, s.num_cached_tokens)
                    for s, n in zip(seqs, num_new_tokens, strict=True)
                ]
            )
            return prefill(seqs, num_new_tokens, on_layer, logprobs)

        def spy_decode(seqs: list[Sequence], logprobs: StepLogprobs | None = None) -> list[int]:
            self.decodes.append([s.request_id for s in seqs])
            return decode(seqs, logprobs)

        runner.prefill_choices = spy_prefill  # type: ignore[method-assign]
        runner.decode = spy_decode  # type: ignore[method-assign]

    def chunks(self, request_id: str) -> list[int]:
        return [n for call in self.prefills for rid, _, n, _ in call if rid == request_id]

    def cached(self, request_id: str) -> int:
        """Prefix-hit tokens found when the request (last) started computing from scratch."""
        starts = [c for call in self.prefills for rid, *_, c in call if rid == request_id]
        return starts[-1] if starts else 0


def engine_config(model_dir: Path, num_kv_blocks: int, **overrides: Any) -> BatonConfig:
    return BatonConfig(model=str(model_dir), num_kv_blocks=num_kv_blocks, **overrides)


KV_TRANSPORTS = ("shm", "pool")  # what EnginePair can wire on a CPU (cuda-ipc needs a GPU)


class EnginePair:
    """The production PrefillEngine and DecodeEngine, built as the services build them
    (``build_prefill_engine`` / ``build_decode_engine``: each its own ModelRunner, KV cache and
    connector of the configured ``transport``, on one spill folder), wired as the services wire
    them through the broker: prefill's handoffs become decode ``add``s, decode's KV releases go
    to prefill's ``release``, tokens are gathered per request. Plumbing only: every scheduling,
    caching and stopping decision is the engines'.

    ``shm``: prefill copies each handoff into the spill store, decode reads and deletes it.
    ``pool``: prefill's KV cache is a shared file in the spill folder; decode copies blocks out
    of it and its release notices unpin them. ``close()`` gives back the pool (files, mappings).
    """

    def __init__(
        self, prefill: PrefillEngine, decode: DecodeEngine, spill_dir: Path, transport: str = "shm"
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.spill_dir = spill_dir
        self.transport = transport
        self.prefill_log = ForwardLog(prefill.runner)
        self.decode_log = ForwardLog(decode.runner)
        self.requests: dict[str, NewRequest] = {}
        # By request id; a request with n > 1 by "<id>/<choice index>", one entry per choice.
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}  # request id -> "stop" | "length"
        self.errors: dict[str, RequestError] = {}
        self.handoffs: dict[str, Handoff] = {}
        self.loads: list[KVTransferStat] = []  # decode: KV that arrived through a transport
        self.aborted: set[str] = set()  # cancelled here, or answered by a shell
        self.expired: set[str] = set()  # retired silently by an engine (deadline)
        self.decode_running: list[int] = []  # decode's running batch size after each step
        self.swapped: list[str] = []  # requests decode swapped out (and took back), in order
        # The entries of requests that asked (shared/runtime/logprobs.py), in output order.
        self.logprobs: dict[str, list[Entry]] = {}
        self.prompt_logprobs: dict[str, list[Entry]] = {}
        self.travelling: set[str] = set()  # choices (n > 1) that left their input: swapped out

    @classmethod
    def build(
        cls,
        model_dir: Path,
        spill_dir: Path,
        *,
        transport: str = "shm",
        prefill_blocks: int = 128,
        decode_blocks: int = 128,
        spill_max_bytes: int = 1 << 30,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
    ) -> EnginePair:
        """``transport``: ``BATON_KV_TRANSPORT`` of both engines. ``prefill`` / ``decode``:
        BatonConfig overrides for that engine."""
        kv: dict[str, Any] = {
            "kv_transport": transport,
            "spill_dir": str(spill_dir),
            "spill_max_bytes": spill_max_bytes,
        }
        p = build_prefill_engine(
            engine_config(model_dir, prefill_blocks, **{**kv, **(prefill or {})}), model_dir
        )
        try:
            d = build_decode_engine(
                engine_config(model_dir, decode_blocks, **{**kv, **(decode or {})}), model_dir
            )
        except BaseException:
            p.connector.close()
            raise
        return cls(p, d, Path(spill_dir), transport)

    def close(self) -> None:
        """Give back what the connectors hold (the pool file and mappings); idempotent."""
        self.decode.connector.close()
        self.prefill.connector.close()

    def __enter__(self) -> EnginePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, **kw: Any
    ) -> AddResult:
        """Submit to prefill; arrival order is the order of ``add`` calls unless given."""
        kw.setdefault("arrival_time", float(len(self.requests)))
        req = NewRequest(request_id, list(prompt), sampling, **kw)
        result = self.prefill.add(req)
        if result is AddResult.ADDED:
            self.requests[request_id] = req
            for name in self.names(request_id):
                self.tokens[name] = []
        return result

    def names(self, request_id: str) -> list[str]:
        """Its entries in ``tokens`` and ``finish``: one per choice."""
        n = self.requests[request_id].sampling.n
        return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]

    def name(self, request_id: str, choice_index: int) -> str:
        return self.names(request_id)[choice_index]

    def to_decode(self, h: Handoff) -> NewRequest:
        """A handoff as decode's shell makes it a request (services/shell/engine_service.py)."""
        return dataclasses.replace(
            self.requests[h.request_id],
            output_token_ids=list(h.output_token_ids),
            kv=h.kv,
            choices=list(h.choices),
            choice_index=h.choice_index,
        )

    def step(self, now: float | None = None) -> tuple[StepOutput | None, StepOutput | None]:
        """One step of each engine that has work (prefill first, as the services race)."""
        p_out = d_out = None
        if self.prefill.has_work():
            p_out = self.prefill.step(now)
            self.collect(p_out, prefill=True)
            for h in p_out.handoffs:
                self.handoffs[h.request_id] = h
                assert self.decode.add(self.to_decode(h), now) is AddResult.ADDED, h.request_id
        if self.decode.has_work():
            d_out = self.decode.step(now)
            self.collect(d_out)
            self.loads.extend(d_out.transfers)
            self.deliver_releases(d_out)
            self.decode_running.append(self.decode.num_running)
            for h in d_out.handoffs:  # swapped out: back through baton.decode, to this worker
                self.swapped.append(h.request_id)
                if h.choice_index is not None:
                    self.travelling.add(self.name(h.request_id, h.choice_index))
                assert self.decode.add(self.to_decode(h), now) is AddResult.ADDED, h.request_id
        return p_out, d_out

    def deliver_releases(self, out: StepOutput) -> None:
        """Decode's KV release notices to prefill, as the shells route them (pooled transports:
        addressed to the sending worker; the spill store sends none)."""
        for notice in out.releases:
            assert notice.sender_id == self.prefill.connector.release_route, notice
            self.prefill.release(notice)

    def run(
        self, max_steps: int = 10_000, between: Callable[[int], None] | None = None
    ) -> dict[str, list[int]]:
        """Step until both engines are idle; ``between(i)`` runs before step ``i`` (to add
        requests while others run). Every request must end: a finish reason, an error, an
        expiry, or an abort."""
        with torch_threads(1):
            for i in range(max_steps):
                if between is not None:
                    between(i)
                if not (self.prefill.has_work() or self.decode.has_work()):
                    break
                self.step()
            else:
                raise RuntimeError("the engines did not finish")
            if self.transport != "shm":
                # Notices made outside a step (a discard on abort or expiry) leave with decode's
                # next step; a service steps even when idle, so deliver them as it would.
                self.deliver_releases(self.decode.step())
        ended = (
            set(self.finish)
            | self.expired
            | {name for rid in self.errors.keys() | self.expired for name in self.names(rid)}
        )
        assert ended >= self.tokens.keys() - self.aborted, sorted(self.tokens.keys() - ended)
        return self.tokens

    def abort(self, request_id: str) -> bool:
        """Cancel as the shells do: every engine drops it."""
        self.aborted.update([request_id, *self.names(request_id)])
        in_prefill = self.prefill.abort(request_id)
        in_decode = self.decode.abort(request_id)
        return bool(in_prefill or in_decode)

    def collect(self, out: StepOutput, prefill: bool = False) -> None:
        """Gather a step's tokens and errors (tests that step one engine themselves call it)."""
        for t in out.tokens:
            name = self.name(t.request_id, t.choice_index)
            assert name not in self.finish, f"{name} got tokens after finishing"
            assert t.request_id not in self.expired, f"{t.request_id} got tokens after expiring"
            got = self.tokens[name]
            assert t.index == len(got), (name, t.index, len(got))  # in order, no gaps
            got.extend(t.token_ids)
            if t.logprobs is not None:
                self.logprobs.setdefault(t.request_id, []).extend(t.logprobs)
            if t.prompt_logprobs is not None:
                self.prompt_logprobs[t.request_id] = t.prompt_logprobs
            if t.finish_reason is not None:
                self.finish[name] = t.finish_reason
        for e in out.errors:
            assert e.request_id not in self.errors and e.request_id not in self.finish
            self.errors[e.request_id] = e
        handed_off = {h.input_key or h.request_id for h in out.handoffs}
        if prefill:  # a layer-wise handoff leaves a step before its request retires there
            handed_off |= self.handoffs.keys()
        for key in out.retired:
            rid, _, index = key.partition("\x00")  # an input of one choice (inputs.choice_key)
            names = [self.name(rid, int(index))] if index else self.names(rid)
            gone = self.finish.keys() | self.travelling | self.aborted
            if not set(names) <= gone and rid not in self.errors and key not in handed_off:
                self.expired.add(rid)

    def assert_clean(self) -> None:
        """Nothing leaked: all blocks back, no request, no pinned handoff, no spilled entry (a
        pooled transport's own pool file is the only thing in the spill folder)."""
        assert_idle(self.prefill)
        assert_idle(self.decode)
        assert not self.prefill._handed_off and not self.decode._kv
        assert self.prefill.connector.stats().pinned_blocks == 0
        assert self.spilled() == []

    def spilled(self) -> list[str]:
        """Spill-store entries in the spill folder (for ``pool``: anything but its pool file)."""
        names = os.listdir(self.spill_dir)
        if self.transport == "shm":
            return names
        return [n for n in names if not n.startswith(f"{self.transport}-")]


def assert_idle(engine: EngineCore) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, (engine.kind, bm.num_used_blocks)
    assert not engine.requests and not engine.has_work(), engine.kind
    assert engine.num_running == engine.num_waiting == 0


def scattered_tables(
    context_lens: list[int], num_blocks: int, block_size: int
) -> tuple[list[list[int]], list[int]]:
    """Block tables of sequences of ``context_lens`` over blocks in a shuffled order (as a busy
    pool hands them out), and each sequence's slot for its newest token."""
    blocks = random.Random(0).sample(range(num_blocks), num_blocks)
    tables, slots, start = [], [], 0
    for n in context_lens:
        nblk = (n + block_size - 1) // block_size
        tables.append(blocks[start : start + nblk])
        start += nblk
        slots.append(tables[-1][(n - 1) // block_size] * block_size + (n - 1) % block_size)
    return tables, slots


def assert_prefix_chunk_reads_the_cache(
    codec: KVCodec,
    cache: torch.Tensor,
    widened: torch.Tensor,
    rounding: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """A prefill chunk after a cached prefix, over ``cache`` (a layer of ``codec``'s rows), as
    fp32 attention over ``widened`` (the same values in fp32) with the chunk's own K/V passed
    through ``rounding`` (the codec's): a chunk reads its own K/V back from the cache too."""
    from shared.runtime.attention import TorchAttentionBackend
    from shared.runtime.kv_codec import make_kv_codec

    num_blocks, bs, hkv, d = widened.shape[1:]
    prefix, n, table = 20, 9, [5, 2]
    slots = [table[p // bs] * bs + p % bs for p in range(prefix, prefix + n)]
    q, k, v = torch.randn(n, 2 * hkv, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    outs = []
    rounded = (rounding(k), rounding(v))
    for c, layer, kv in ((codec, cache, (k, v)), (make_kv_codec("auto"), widened, rounded)):
        backend = TorchAttentionBackend(num_blocks, bs, hkv, d**-0.5, torch.device("cpu"), c)
        meta = backend.prefill_metadata(slots, [table], [n], [prefix + n])
        outs.append(meta.forward(q, kv[0], kv[1], layer.clone()))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


PAIR_PROMPTS = [
    [(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 19, 40, 77))
]


def cache_pair_agreement(model: Path, folder: Path, transport: str, kv_cache_dtype: str) -> float:
    """Greedy tokens (24 a prompt of :data:`PAIR_PROMPTS`) through a prefill/decode pair over
    ``transport`` whose caches are ``kv_cache_dtype``, every KV through the transport, against
    the same pair's with the model's own dtype ("auto"): the share of tokens that agree position
    by position."""
    prompts = PAIR_PROMPTS
    outputs = {}
    for dtype in ("auto", kv_cache_dtype):
        kw = {"kv_cache_dtype": dtype}
        with EnginePair.build(model, folder / dtype, transport=transport, prefill=kw,
                              decode=kw) as pair:  # fmt: skip
            for i, prompt in enumerate(prompts):
                assert pair.add(f"r{i}", prompt, greedy(24, ignore_eos=True)) is AddResult.ADDED
            outputs[dtype] = pair.run()
            assert len(pair.loads) == len(prompts)  # every KV went through the transport
            pair.assert_clean()
    same = sum(
        a == b
        for rid in outputs["auto"]
        for a, b in zip(outputs["auto"][rid], outputs[kv_cache_dtype][rid], strict=True)
    )
    return same / (24 * len(prompts))


def greedy(max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def hf_greedy(
    model: Any, prompt: list[int], params: SamplingParams, **generate_kw: Any
) -> list[int]:
    """transformers' greedy continuation: stops at the model's EOS ids, or with ``ignore_eos``
    generates past them (``eos_token_id=None``: nothing is masked, exactly Baton's ignore_eos).
    ``generate_kw``: more of ``generate``'s settings (``repetition_penalty``, other EOS ids).

    Passed as keyword arguments: a GenerationConfig object holding ``eos_token_id=None`` is
    merged with the model's defaults by transformers 5, which brings the EOS ids back.
    """
    ids = torch.tensor([prompt])
    overrides: dict[str, Any] = {"eos_token_id": None} if params.ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=params.max_tokens,
            **(overrides | generate_kw),
        )
    return out[0, len(prompt) :].tolist()
