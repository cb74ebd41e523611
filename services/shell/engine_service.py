"""The one engine loop, for prefill and decode: consume → ``engine.add``/``abort`` → ``step`` →
publish in the background → ack what the engine retired once its outputs are confirmed.

Threading: deliveries and control messages only land in ``inbox`` / the abort queue (event loop);
the loop hands them to the engine between steps, and ``step`` runs in a worker thread — so the
engine is only ever touched by one thread at a time (its invariant, ``shared/engine/engine.py``).

A work message becomes a :class:`NewRequest` here (``to_request``) and each handoff of a step a
``HandoffMsg`` (``handoff_messages``); a subclass (``services/prefill``, ``services/decode``) names
its message type and its policy. Everything else — intake, drain, acks, metrics — is here and in
the service shell. The scheduling policy (``self.policy``) is fed by the subclass and answers with
the prefetch window after each step (``window``) and whether intake is open (``intake_open``).

What this shell knows of its engine: the verbs, ``engine.info`` and what ``step`` returns —
never the runner, the connectors or the scheduler behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
from aio_pika.abc import AbstractIncomingMessage

from services.shell.broker import Outgoing
from services.shell.cpus import check_nice, yield_thread_cpu
from services.shell.event_hold import EventHold
from services.shell.prefetch import PrefetchWindow
from services.shell.shell import ServiceShell, ack, detok_events, peek_request_id, requeue
from services.shell.step_trace import StepTrace
from shared.config import BatonConfig
from shared.engine.cpu_share import CpuShareManager
from shared.engine.engine import EngineCore
from shared.engine.load import EngineLoad
from shared.engine.outputs import AddResult, Handoff, NewRequest, StepOutput
from shared.flow_control.policy import SchedulingPolicy
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.messages import (
    ControlMsg,
    HandoffMsg,
    KVRelease,
    KVReleaseMsg,
    PrefillMsg,
    TokenEvent,
)
from shared.wire.queues import DECODE_QUEUE, kv_release_queue

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 0.5  # an idle engine still steps this often (deadlines, KV leases, orphan sweeps)
BUSY_WAIT_S = 0.01  # work that cannot be scheduled now (KV blocks short): re-check this often
# A decode step waiting for a prefill wave (decode_yields) looks again this often: prefill's
# end is not announced to the other process.
YIELD_POLL_S = 0.01
# A lone request on waking waits for company at most this share of its own forward's time
# (:func:`lone_wait_s`).
LONE_WAIT_SHARE = 0.125


@dataclass
class Received:
    """A decoded work message and the delivery to ack once its outcome is confirmed."""

    msg: Any  # PrefillMsg | HandoffMsg
    delivery: AbstractIncomingMessage


def lone_wait_s(tokens: int, tokens_per_s: float, cap_s: float) -> float:
    """How long a request of ``tokens`` that woke the engine alone waits for company:
    LONE_WAIT_SHARE of its forward's time at the engine's last measured rate, at most ``cap_s``;
    0 before any forward was measured."""
    if tokens <= 0 or tokens_per_s <= 0:
        return 0.0
    return min(cap_s, LONE_WAIT_SHARE * tokens / tokens_per_s)


class EngineService(ABC):
    name: str
    queue: str
    message_type: type[PrefillMsg] | type[HandoffMsg]

    def __init__(
        self,
        config: BatonConfig,
        engine: EngineCore,
        prefetch: int,
        batch_wait: tuple[float, float] = (0.0, 0.0),
        event_hold_s: float = 0.0,
        cpu_share: CpuShareManager | None = None,
        yield_s: float = 0.0,
    ) -> None:
        """``prefetch``: the largest window this service ever wants (the per-consumer cap); the
        policy's answer (``window``) moves it below that after each step. ``batch_wait``: the
        quiet gap and the cap of :meth:`_gather` (seconds). ``event_hold_s``: how long a step's
        token events may wait to share a message with later steps' (event_hold.py).
        ``cpu_share``: the thread budget shared with the deployment's other engines (the engine
        was built with its ``rebalance`` between layers); None leaves torch's count alone.
        ``yield_s``: how long a step may wait for a prefill wave (decode's BATON_DECODE_YIELD_S;
        prefill never waits)."""
        self.config = config
        self.engine = engine
        self.batch_wait_s, self.batch_wait_max_s = batch_wait
        self.events = EventHold(event_hold_s)
        self.shell = ServiceShell(config, self.name, prefetch)
        self.policy = SchedulingPolicy(config)
        self.prefetch = PrefetchWindow(self.shell.broker, self.shell.metrics, prefetch)
        self.load = EngineLoad()  # after the last step
        self.inbox: deque[Received] = deque()  # received, not yet handed to the engine
        # Handed to the engine, by input key (NewRequest.input_key); acked once retired.
        self.inflight: dict[str, Received] = {}
        self._aborts: deque[tuple[str, int | None]] = deque()  # (request id, choice index)
        self._releases: deque[KVRelease] = deque()  # notices for KV this engine sent
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self.cpu_share = cpu_share
        self.yield_s = yield_s
        self._last_step_at = 0.0  # time.monotonic() after the last step
        self.tokens_per_s = 0.0  # the last forward's tokens over its seconds (0: none yet)
        self.trace = StepTrace(config.step_trace, self.name)
        # Every step on one thread of its own. torch's thread count (OpenMP's) is a setting of
        # the calling thread, and each calling thread keeps its own OpenMP team: steps spread
        # over asyncio's shared pool (asyncio.to_thread; the spill poller uses it too) would run
        # at whatever count that worker last had, not the budget's.
        # Its nice (BATON_STEP_NICE) lets the pipeline's light work preempt the forwards;
        # checked here, since a worker's initializer that raises only breaks the pool.
        check_nice(config.step_nice)
        self._stepper = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"{self.name}-step",
            initializer=yield_thread_cpu,
            initargs=(config.step_nice,),
        )
        self.shell.metrics.watch_device(config.device)
        self.shell.metrics.set_engine(engine.info)
        if engine.info.spill_store:
            self.shell.poller.watch_spill(engine.spill_store_bytes)

    # --- translation (the subclass) -------------------------------------------------------------
    def to_request(self, msg: PrefillMsg | HandoffMsg) -> NewRequest:
        """The engine's view of a work message; a handoff also brings its output and KV."""
        handoff = msg if isinstance(msg, HandoffMsg) else None
        return NewRequest(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling=msg.sampling,
            output_token_ids=handoff.output_token_ids if handoff else [],
            priority=msg.priority,
            arrival_time=msg.arrival_time,
            deadline=msg.deadline,
            kv=handoff.kv if handoff else None,
            choices=[(c[0], c[1]) for c in handoff.choices] if handoff else [],
            choice_index=handoff.choice_index if handoff else None,
        )

    def handoff_messages(
        self, handoffs: list[Handoff], originals: dict[str, PrefillMsg | HandoffMsg]
    ) -> list[Outgoing]:
        """Handoffs to ``baton.decode``: prefill's finished prompts, and decode's swapped-out
        sequences (any decode worker resumes them); ``originals``: their inputs by id."""
        outs = []
        for h in handoffs:
            msg = originals[h.input_key or h.request_id]
            handoff = HandoffMsg(
                request_id=h.request_id,
                prompt_token_ids=msg.prompt_token_ids,
                output_token_ids=h.output_token_ids,
                sampling=msg.sampling,
                kv=h.kv,
                priority=msg.priority,  # the client's; the AMQP priority is the effective one
                arrival_time=msg.arrival_time,
                deadline=msg.deadline,
                choice_index=h.choice_index,
                choices=[[index, token] for index, token in h.choices],
            )
            outs.append(Outgoing(DECODE_QUEUE, handoff.encode(), priority=h.priority))
            self.shell.metrics.on_published(DECODE_QUEUE, msg.priority, h.priority, "aging")
        return outs

    # --- policy (the subclass) ------------------------------------------------------------------
    @abstractmethod
    def window(self, load: EngineLoad) -> int:
        """The policy's prefetch for this consumer, given the engine's load after a step."""

    def intake_open(self) -> bool:
        """False while the policy pauses intake: deliveries wait in the inbox, not the engine."""
        return True

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.shell.start(
            on_control=self._on_control, on_drain=self._give_back_inbox, idle=self._idle
        )
        await self.prefetch.start()
        self._loop = asyncio.create_task(self._run())
        route = self.engine.info.release_route
        if route is not None:  # a pooled sender: receivers tell it when its pins may go
            await self.shell.broker.consume_private(kv_release_queue(route), self._on_release)
        await self.shell.consume(self.queue, self._on_delivery, on_poison=self._answer_poison)

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        await self.prefetch.stop()
        await self.shell.stop()
        # A step still running finishes before the engine closes under it.
        await asyncio.get_running_loop().run_in_executor(None, self._stepper.shutdown)
        self.engine.close()
        self.trace.close()
        if self.cpu_share is not None:
            self.cpu_share.close()

    async def wait_finished(self) -> None:
        await self.shell.wait_finished()

    # --- intake (event loop; never touches the engine) ------------------------------------------
    async def _on_delivery(self, delivery: AbstractIncomingMessage) -> None:
        try:
            msg = self.message_type.decode(delivery.body, self.config.max_message_bytes)
            self._check_token_ids(msg)
        except ProtocolError as exc:
            await self._fail_unreadable(delivery, exc)
            return
        self.inbox.append(Received(msg, delivery))
        self._wake.set()

    def _check_token_ids(self, msg: Any) -> None:
        """A token id outside the vocabulary would fail the forward of everything batched with
        it: refused here, like any malformed message (the tokenizer refuses a client's)."""
        vocab = self.engine.info.vocab_size
        firsts = [c[1] for c in getattr(msg, "choices", ())]  # n > 1: each choice's first token
        for ids in (msg.prompt_token_ids, getattr(msg, "output_token_ids", ()), firsts):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise ProtocolError(ErrorCode.INTERNAL, f"token id outside 0..{vocab - 1}")

    async def _on_release(self, message: AbstractIncomingMessage) -> None:
        try:
            msg = KVReleaseMsg.decode(message.body, self.config.max_message_bytes)
        except ProtocolError as exc:  # harmless to drop: the lease frees the blocks
            log.warning("unreadable KV release notice ignored", reason=exc.message)
            return
        self._releases.extend(msg.releases)
        self._wake.set()

    def _on_control(self, ctl: ControlMsg, sender: str | None) -> None:
        # Only aborts (the shell let through only a trusted sender's): a client's cancel is the
        # detokenizer's to check against the request's owner; it then sends the abort.
        if ctl.type == "abort" and ctl.request_id is not None:
            self._aborts.append((ctl.request_id, ctl.choice_index))
            self._wake.set()

    async def _give_back_inbox(self) -> None:
        """Drain: what was received but never handed to the engine goes back to the queue."""
        items = list(self.inbox)
        self.inbox.clear()
        for item in items:
            await requeue(item.delivery)
        if items:
            log.info("returned unstarted work to the queue", count=len(items), queue=self.queue)

    def _idle(self) -> bool:
        return not self.inbox and not self.inflight and self.engine.is_drained()

    # --- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._iterate()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("engine loop error", service=self.name)
                await asyncio.sleep(0.1)

    async def _iterate(self) -> None:
        trace = self.trace
        if not self.engine.has_work() and not self._has_input():
            with trace.span("idle"):
                await self._wait(IDLE_WAIT_S)
            if self._has_input() and self.batch_wait_s > 0:
                with trace.span("gather"):
                    await self._gather()
        self._take_in()
        if self._yields_step():
            with trace.span("yield", running=self.engine.num_running):
                await self._wait(YIELD_POLL_S)
            return
        started = time.monotonic()
        out = await asyncio.get_running_loop().run_in_executor(self._stepper, self._step)
        self._last_step_at = time.monotonic()
        if out.stats is not None and out.stats.forward_s > 0 and out.stats.num_scheduled_tokens:
            self.tokens_per_s = out.stats.num_scheduled_tokens / out.stats.forward_s
        if trace:
            stats = out.stats
            trace.record(
                "step", started, self._last_step_at,
                forward_s=round(stats.forward_s, 6) if stats else None,
                seqs=stats.num_seqs if stats else 0,
                tokens=stats.num_scheduled_tokens if stats else 0,
                threads=stats.num_threads if stats else None,
            )  # fmt: skip
        with trace.span("publish"):
            self._publish(out)
            self.load = out.load
            self.prefetch.want(self.window(out.load))
        if out.stats is None and self.engine.has_work() and not self._has_input():
            with trace.span("busy_wait"):
                await self._wait(BUSY_WAIT_S)

    async def _gather(self) -> None:
        """On waking to work: a burst waits for the rest of it to join the first batch, until
        none has come for ``batch_wait_s`` (at most ``batch_wait_max_s``).

        Why until quiet, not one fixed gap: a burst reaches prefill over tens of ms (each
        request tokenized and published in turn, in clusters a few ms apart), so one short gap
        would start the first wave with a few of them; decode would then begin those while
        prefill ran the rest, each on half the cores. Hence a default gap longer than the
        clusters' spacing (prefill_batch_wait_s).

        A request that wakes the engine alone may still lead a burst: the tokenizer commits
        the first request of a burst on its own, and the rest a commit later (its group commit,
        services/shell/tx_outbox.py), so the first wave of an all-at-once burst would be that
        one prompt while the rest waited for it. It waits for a second request, for at most
        :func:`lone_wait_s`: a share of its own forward's time, so a request that is alone
        loses little, and a short one (whose pipeline overhead a wait would double) none."""
        await asyncio.sleep(0)  # take in what the socket already holds
        if not self.inbox:
            return
        if len(self.inbox) == 1:
            wait = lone_wait_s(self._work_tokens(self.inbox[0]), self.tokens_per_s,
                               self.batch_wait_s)  # fmt: skip
            if wait > 0:
                await self._wait(wait)  # a delivery wakes it
            if len(self.inbox) <= 1:
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.batch_wait_max_s
        while True:
            seen = len(self.inbox)
            await asyncio.sleep(min(self.batch_wait_s, max(0.0, deadline - loop.time())))
            if len(self.inbox) == seen or loop.time() >= deadline:
                return

    def _work_tokens(self, item: Received) -> int:
        """Tokens a request's forward computes (a lone request's wait for company scales with
        them, :meth:`_gather`); 0: it never waits."""
        return 0

    def _yields_step(self) -> bool:
        """Whether the next step waits for a prefill wave on the shared cores (decode only:
        ``yield_s``; CpuShareManager.decode_yields)."""
        share = self.cpu_share
        if share is None or not self.engine.has_work():
            return False
        since = time.monotonic() - self._last_step_at
        return share.decode_yields(since, self.yield_s, self.engine.num_running, self.yield_slack_s)

    def yield_slack_s(self) -> float:
        """How much longer, beyond ``yield_s``'s bound, the next step may wait for a prefill
        wave (decode: its streams' slack under the TPOT objective)."""
        return math.inf

    def _step(self) -> StepOutput:
        """One engine step, in the worker thread, at this engine's share of the cores."""
        share = self.cpu_share
        if share is None:
            return self.engine.step()
        seqs = self.engine.num_waiting + self.engine.num_running
        out = share.run_step(self.engine.has_work(), self.engine.step, seqs)
        if not self.engine.has_work():
            share.idle()  # the other engines' next steps may take these cores
        return out

    def wake(self) -> None:
        """Run the loop now (e.g. the policy reopened intake)."""
        self._wake.set()

    def _has_input(self) -> bool:
        """Anything for ``_take_in`` (a draining service takes no new work)."""
        return (
            bool(self._aborts)
            or bool(self._releases)
            or (bool(self.inbox) and not self.shell.draining and self.intake_open())
        )

    async def _wait(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        self._wake.clear()

    def _take_in(self) -> None:
        """Between steps: new work and aborts into the engine (synchronous: nothing interleaves)."""
        now = time.time()
        self.engine.observe_backlog(self.policy.prefill_backlog)
        while self.inbox and not self.shell.draining and self.intake_open():
            item = self.inbox.popleft()
            try:
                self._add(item, now)
            except Exception as exc:  # a bug must not leave the request unanswered and unacked
                rid = item.msg.request_id
                log.exception("engine refused a request", request_id=rid)
                reason = f"{self.name} could not take the request: {type(exc).__name__}"
                event = error_event(rid, ErrorCode.INTERNAL, reason)
                self.shell.publish_then_ack(self._detok([event], now), [item.delivery], "error")
        while self._releases:
            self.engine.release(self._releases.popleft(), now)
        while self._aborts:
            for key in self.engine.abort(*self._aborts.popleft()):
                aborted = self.inflight.pop(key, None)
                if aborted is not None:
                    self.shell.publish_then_ack([], [aborted.delivery], "abort")

    def _add(self, item: Received, now: float) -> None:
        rid = item.msg.request_id
        req = self.to_request(item.msg)
        key = req.input_key
        result = self.engine.add(req, now)
        if result is AddResult.ADDED:
            self.inflight[key] = item
        elif result is AddResult.DUPLICATE and key in self.inflight:
            # A second copy of a request running here (redelivered after a reconnect, or sent
            # twice upstream): keep the newest delivery unacked — the older one's channel may
            # be gone — and ack the other.
            old = self.inflight[key]
            self.inflight[key] = Received(old.msg, item.delivery)
            self.shell.spawn(ack(old.delivery))
        elif result is AddResult.TOO_LONG:
            n = len(req.prompt_token_ids) + len(req.output_token_ids)
            reason = f"{n} tokens do not fit this engine (max {self.engine.info.max_model_len})"
            log.info("request too long for the engine", request_id=rid, reason=reason)
            event = error_event(rid, ErrorCode.PROMPT_TOO_LONG, reason)
            self.shell.publish_then_ack(self._detok([event], now), [item.delivery], "refusal")
        else:  # STALE: cancelled or past its deadline; the detokenizer answers it
            self.shell.spawn(ack(item.delivery))

    def _publish(self, out: StepOutput) -> None:
        self.shell.metrics.on_engine_step(out)
        if out.stats is not None:
            stats = out.stats
            self.policy.observe_step(stats.forward_s, stats.num_seqs, stats.num_scheduled_tokens)
        if out.releases:
            self.publish_releases(out.releases)
        if not out and not self.events:
            return
        events = [
            TokenEvent(
                t.request_id,
                t.index,
                t.token_ids,
                t.finish_reason,
                scheduled_at=t.scheduled_at,
                choice_index=t.choice_index,
                logprobs=t.logprobs,
                prompt_logprobs=t.prompt_logprobs,
            )
            for t in out.tokens
        ]
        events += [error_event(e.request_id, e.code, e.message) for e in out.errors]
        urgent = bool(out.errors or out.handoffs or out.retired) or any(
            t.finish_reason is not None for t in out.tokens
        )
        now = time.time()
        events = self.events.offer(events, now, urgent)
        outs = self._detok(events, now)
        if out.handoffs:
            keys = {h.input_key or h.request_id for h in out.handoffs}
            originals = {key: self.inflight[key].msg for key in keys}
            outs += self.handoff_messages(out.handoffs, originals)
        retired = [self.inflight.pop(rid).delivery for rid in out.retired if rid in self.inflight]
        if outs or retired:
            task = self.shell.publish_then_ack(outs, retired, f"{self.name} outputs")
            if retired:  # how long inputs stay held after their step (the policy's window)
                ended = time.monotonic()
                task.add_done_callback(
                    lambda _: self.policy.observe_release(time.monotonic() - ended)
                )

    def _detok(self, events: list[TokenEvent], now: float) -> list[Outgoing]:
        return detok_events(events, now, self.config.detok_shards)

    def publish_releases(self, releases: list[KVRelease]) -> None:
        """Receiver → sender: one best-effort message per sending worker and step. A lost one
        costs nothing but time: the sender's lease frees the blocks."""
        by_sender: dict[str, list[KVRelease]] = {}
        for notice in releases:
            by_sender.setdefault(notice.sender_id, []).append(notice)
        for sender_id, notices in by_sender.items():
            body = KVReleaseMsg(releases=notices).encode()
            out = Outgoing(kv_release_queue(sender_id), body, persistent=False)
            self.shell.spawn(self._send_release(out))

    async def _send_release(self, out: Outgoing) -> None:
        try:
            await self.shell.publish(out)
        except Exception as exc:
            log.warning("KV release notice not sent; the lease will free it", error=str(exc))

    async def _fail_unreadable(self, delivery: AbstractIncomingMessage, exc: ProtocolError) -> None:
        """A work message we cannot read (version skew, corruption): answer its request if the
        id is recoverable, so the client still gets its one terminal reply; dead-letter it."""
        rid = peek_request_id(delivery.body, self.config.max_message_bytes)
        log.error("unreadable work message", request_id=rid, reason=exc.message)
        if rid is not None:
            event = error_event(rid, ErrorCode.INTERNAL, exc.message)
            await self.shell.broker.publish_many(self._detok([event], time.time()))
        await delivery.reject(requeue=False)

    async def _answer_poison(self, delivery: AbstractIncomingMessage, failures: int) -> None:
        """About to be dead-lettered: its request gets an ``internal`` error."""
        rid = peek_request_id(delivery.body, self.config.max_message_bytes)
        log.error("request set aside as poison", request_id=rid, failures=failures)
        if rid is not None:
            reason = f"{self.name} failed on this request {failures} times; it was set aside"
            event = error_event(rid, ErrorCode.INTERNAL, reason)
            await self.shell.broker.publish_many(self._detok([event], time.time()))


def error_event(request_id: str, code: ErrorCode, message: str) -> TokenEvent:
    return TokenEvent(request_id, 0, [], error_code=code.value, error_message=message)
