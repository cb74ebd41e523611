"""The prefill engine: batch prompts under a token budget, sample each first token, hand off.

Per completed prompt: its first token is an output; unless that token already ends the request
(EOS, ``max_tokens`` 1, a prompt filling all but one position), its KV goes to the connector and
a :class:`Handoff` is an output. A sent request's blocks stay allocated until the connector says
they may be freed (at once for a copy transport; on decode's release or a lease expiry for a
pooled one).

With a host tier (``BATON_KV_HOST_CACHE_MB``, shared/runtime/kv_tiers.py) a pooled transport
cannot carry a prompt holding host blocks (decode reads the sender's device pool in place):
such a prompt goes through ``spill``, the spill store, which copies it at once.

Parallel sampling (``n`` > 1): the prompt is computed once, and its one row of logits gives
every choice its first token; one handoff carries them all, with the one copy of the KV, and
decode forks it into a sequence per choice (decode.py).
"""

from __future__ import annotations

import time

from shared.engine.engine import EngineCore
from shared.engine.layerwise import PrefillStreams
from shared.engine.outputs import KVTransferStat, NewRequest, StepOutput, TokenOutput
from shared.runtime.logprobs import Entry, StepLogprobs, unscored
from shared.runtime.sequence import Sequence
from shared.scheduling import PrefillScheduler
from shared.scheduling.prefill_scheduler import PrefillBatch
from shared.wire.messages import KVRelease


class PrefillEngine(EngineCore):
    kind = "prefill"
    scheduler: PrefillScheduler

    def _setup(self) -> PrefillScheduler:
        # Sent to a connector, blocks not yet freed: request id -> its sequence.
        self._handed_off: dict[str, Sequence] = {}
        c = self.config
        # Layer-wise handoffs (layerwise.py): announced prompts, and the batch whose forward
        # waits one step for their handoffs to go out.
        layerwise = self.connector.layerwise and c.kv_layerwise and self.runner.host_tier is None
        self._streams = PrefillStreams(self.connector) if layerwise else None
        self._announced_batch: PrefillBatch | None = None
        # prompt_logprobs of prompts still being computed (chunk by chunk): id -> position -> entry
        self._prompt_logprobs: dict[str, dict[int, Entry]] = {}
        return PrefillScheduler(
            self.block_manager,
            c.max_num_batched_tokens,
            c.prefill_max_num_seqs,
            ranking=self.priorities,
        )

    def is_drained(self) -> bool:
        return super().is_drained() and not self._handed_off

    def has_work(self) -> bool:
        return super().has_work() or self._announced_batch is not None

    def _drop(self, key: str) -> str | None:
        self._prompt_logprobs.pop(key, None)
        seq = self.requests.get(key)
        if seq is not None and self._streams is not None and self._streams.fail(key):
            # Announced: decode may be reading its pinned blocks; they wait for its release.
            self.scheduler.running.pop(key, None)
            self._handed_off[key] = seq
            del self.requests[key]
            ended = self._leave(key)
        else:
            ended = super()._drop(key)
        batch = self._announced_batch
        if batch is not None and seq in batch.seqs:  # it waited for its forward: not any more
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]
            self._announced_batch = batch if batch.seqs else None
        return ended

    def release(self, notice: KVRelease, now: float | None = None) -> None:
        """Decode is done with a request's KV (pooled transports)."""
        self.connector.release(notice)
        self._free_handed_off(time.time() if now is None else now)

    def _admit(self, seq: Sequence, req: NewRequest) -> None:
        self.scheduler.add(seq)

    def _step(self, now: float) -> StepOutput:
        out = StepOutput()
        self._expire(now, out)
        self._free_handed_off(now)
        batch = self._announced_batch or self.scheduler.schedule()
        self._announced_batch = None
        if not batch:
            return out
        self._started(batch.seqs, now)
        if self._announce(batch, now, out):
            self._announced_batch = batch  # computed next step, once the handoffs are out
            return out
        started, t0 = time.time(), time.perf_counter()
        asks = any(_asks_logprobs(s) for s in batch.seqs)
        logprobs = StepLogprobs() if asks else None

        def run(rows: list[int]) -> list[list[int] | None]:
            sub = PrefillBatch(
                [batch.seqs[r] for r in rows], [batch.num_new_tokens[r] for r in rows]
            )
            # Announced prompts report each stored layer of the forward that computes them.
            on_layer = self._streams.on_layer(sub) if self._streams is not None else None
            return self.runner.prefill_choices(sub.seqs, sub.num_new_tokens, on_layer, logprobs)

        results = self._forward(batch.seqs, out, run)
        if not results:
            return out
        ran = sorted(results)  # a request that failed alone is gone from the batch
        batch = PrefillBatch([batch.seqs[r] for r in ran], [batch.num_new_tokens[r] for r in ran])
        firsts = [results[r] for r in ran]  # each choice's first token, of completed prompts
        forward_s = time.perf_counter() - t0
        if logprobs is not None:
            for rid, positions in logprobs.prompt.items():
                self._prompt_logprobs.setdefault(rid, {}).update(positions)
        done = self.scheduler.update(batch, [None if t is None else t[0] for t in firsts])
        by_seq = {id(seq): t for seq, t in zip(batch.seqs, firsts, strict=True)}
        for seq in done:
            firsts_of = by_seq[id(seq)] or [seq.last_token_id]
            self._finish_prompt(seq, firsts_of, started, now, out, logprobs)
        self._free_handed_off(now)
        out.stats = self._stats(len(batch), batch.num_tokens, len(done), 0, forward_s)
        return out

    def _announce(self, batch: PrefillBatch, now: float, out: StepOutput) -> bool:
        """Hand off the batch's new prompts layer-wise before computing them (layerwise.py)."""
        if self._streams is None:
            return False
        announced = False
        for seq in batch.seqs:
            if seq.request_id in self._streams or not self._streams.wanted(seq):
                continue
            t0 = time.perf_counter()
            desc = self._send(self.connector, seq, announce=True)
            if desc is None:  # the transport is full: handed off whole at the end instead
                continue
            self._streams.add(seq.request_id)
            out.transfers.append(
                KVTransferStat(desc.transport, desc.nbytes, time.perf_counter() - t0)
            )
            self._hand_off(seq, desc, now, out)  # no output token yet: decode reads it later
            announced = True
        return announced

    def _finish_prompt(
        self,
        seq: Sequence,
        firsts: list[int],
        started: float,
        now: float,
        out: StepOutput,
        logprobs: StepLogprobs | None = None,
    ) -> None:
        """``firsts``: the first token of each choice (one unless ``n`` > 1; the sequence holds
        choice 0's). The prompt's logprobs, if asked for, go with choice 0's first token."""
        rid, token = seq.request_id, seq.last_token_id
        prompt_logprobs = self._prompt_logprobs_of(seq)
        going: list[tuple[int, int]] = []  # the choices that go on to decode
        for index, first in enumerate(firsts):
            reason = self.stop(first, seq.num_tokens, seq.num_output_tokens, seq.sampling)
            sampled = logprobs.sampled.get((rid, index)) if logprobs is not None else None
            out.tokens.append(
                TokenOutput(
                    rid,
                    0,
                    [first],
                    reason,
                    scheduled_at=started,
                    choice_index=index,
                    logprobs=None if sampled is None else [sampled],
                    prompt_logprobs=prompt_logprobs if index == 0 else None,
                )
            )
            if reason is None:
                going.append((index, first))
        if self._streams is not None and rid in self._streams:
            # Announced: its blocks are pinned for decode, which reads the first token (or
            # that the request ended) from the progress record and releases them.
            self._streams.end(rid, token, finished=not going)
            self._handed_off[rid] = seq
        elif going:
            t0 = time.perf_counter()
            tier = self.runner.host_tier
            on_host = tier is not None and tier.holds_host(seq.block_table)
            sender = self.spill if on_host and self.spill is not None else self.connector
            desc = self._send(sender, seq)
            if desc is None:  # the transport is full: decode recomputes
                self.scheduler.free(seq)
            else:
                self._handed_off[rid] = seq
                out.transfers.append(
                    KVTransferStat(desc.transport, desc.nbytes, time.perf_counter() - t0)
                )
            self._hand_off(seq, desc, now, out, going if seq.sampling.n > 1 else None)
        else:
            self.scheduler.free(seq)
        self._retire(rid, out)

    def _prompt_logprobs_of(self, seq: Sequence) -> list[Entry] | None:
        """The finished prompt's logprobs, one per prompt token: the first one's unscored
        (nothing before it), as vLLM's ``None``, but with its id so the prompt reads whole."""
        positions = self._prompt_logprobs.pop(seq.request_id, None) or {}
        if seq.sampling.prompt_logprobs is None:
            return None
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        return [positions.get(p) or unscored(t) for p, t in enumerate(prompt)]

    def _free_handed_off(self, now: float) -> None:
        for sender in self.connectors:
            for rid in sender.pop_freeable(now):
                seq = self._handed_off.pop(rid, None)
                if seq is not None:
                    self.scheduler.free(seq)


def _asks_logprobs(seq: Sequence) -> bool:
    p = seq.sampling
    return p.logprobs is not None or p.prompt_logprobs is not None
