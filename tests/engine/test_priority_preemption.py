"""Priority preemption with a full batch (issue 28): decode A runs ``max_num_seqs`` long
priority-0 generations when a priority-9 request arrives. A swaps the lowest-ranked one out
(spill store, as any swap) and admits the urgent one within two steps; the victim resumes on
decode B (as ``baton.decode`` would hand it to a worker with room), its KV prefetched while B's
step runs. Every completion equals Hugging Face's greedy output, nothing was recomputed, and the
preemption is counted by its cause.
"""

from __future__ import annotations

import time
from pathlib import Path

from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.outputs import AddResult, NewRequest
from tests.engine.test_swap_preemption import (
    Wiring,
    hf_completions,
)
from tests.runtime.helpers import ForwardLog, engine_config, greedy, torch_threads

LONG, SHORT = 48, 8  # output tokens: priority-0 generations, the urgent request
PROMPTS = [[(13 * i + 5 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((19, 26, 33, 22))]
MIN_STEPS = 4


def test_urgent_request_preempts_a_full_batch_and_the_victim_resumes_elsewhere(
    model_dir: Path, tmp_path: Path
) -> None:
    cfg = engine_config(
        model_dir, 64, spill_dir=str(tmp_path / "spill"), max_num_seqs=3,
        decode_preempt_priority_gap=3, decode_preempt_min_steps=MIN_STEPS,
    )  # fmt: skip
    prefill = build_prefill_engine(cfg, model_dir)
    decode_a, decode_b = build_decode_engine(cfg, model_dir), build_decode_engine(cfg, model_dir)
    logs = ForwardLog(decode_a.runner), ForwardLog(decode_b.runner)
    wiring = Wiring(PROMPTS)
    urgent = "r3"
    max_tokens = {f"r{i}": LONG for i in range(3)} | {urgent: SHORT}

    def add_to_prefill(i: int, priority: int) -> None:
        rid = f"r{i}"
        req = NewRequest(rid, PROMPTS[i], greedy(max_tokens[rid], True), priority=priority,
                         arrival_time=time.time())  # fmt: skip
        assert prefill.add(req) is AddResult.ADDED

    def step_all() -> None:
        out = prefill.step()
        wiring.collect(out)
        for h in out.handoffs:
            wiring.deliver([h], decode_a, max_tokens[h.request_id])
        for engine in (decode_a, decode_b):
            out = engine.step()
            wiring.collect(out)
            for h in out.handoffs:  # swapped out: B has room
                wiring.deliver([h], decode_b, max_tokens[h.request_id])

    with torch_threads(1):
        for i in range(3):
            add_to_prefill(i, priority=0)
        while len(decode_a.scheduler.running) < 3 or decode_a.scheduler.num_steps < 2 * MIN_STEPS:
            step_all()
        assert decode_a.scheduler.running.keys() == {"r0", "r1", "r2"}  # full by count
        add_to_prefill(3, priority=9)
        out = prefill.step()
        wiring.collect(out)
        (handoff,) = out.handoffs
        wiring.deliver([handoff], decode_a, SHORT)
        for _ in range(2):  # admitted within two decode steps
            out = decode_a.step()
            wiring.collect(out)
            wiring.deliver(out.handoffs, decode_b, LONG)
            if urgent in decode_a.scheduler.running:
                break
        assert urgent in decode_a.scheduler.running
        for _ in range(500):
            if not any(e.has_work() for e in (prefill, decode_a, decode_b)):
                break
            step_all()
    assert wiring.finished == set(wiring.tokens)

    assert decode_a.scheduler.preemptions_by_cause == {"priority_slot": 1}
    assert decode_a.scheduler.num_swaps == 1 and decode_b.num_swaps_in == 1
    assert decode_b.prefetch is not None and decode_b.prefetch.num_started == 1
    for engine, log in zip((decode_a, decode_b), logs, strict=True):
        assert engine.scheduler.num_preemptions == 0  # no preemption by recompute
        assert log.prefills == []  # and no KV rebuilt
        assert engine.block_manager.num_used_blocks == 0
    assert not list((tmp_path / "spill").rglob("*.kv"))
    assert wiring.completions() == hf_completions(model_dir, PROMPTS, list(max_tokens.values()))
