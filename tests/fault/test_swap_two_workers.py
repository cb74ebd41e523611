"""Swap preemption through the broker, with two decode workers (issue: scheduling).

Every service a process of its own, two decode workers: ``decode`` with a KV cache of 16 blocks
(256 tokens), too small for its share of 12 sequences growing to 120 tokens, and ``decode-2``
with room. ``decode`` preempts by swap: each victim's KV goes to the spill store and the request
back to ``baton.decode``, where whichever worker the broker gives it to (``decode-2`` took 4
of 5 in the run measured here) resumes it by loading that KV. Every completion equals Hugging Face's
greedy output; the metrics show as many swap-ins as swap-outs and not one preemption by
recompute; the log shows both. (Which worker resumes is the broker's choice; the engine-level
test, tests/engine/test_swap_preemption.py, pins the cross-worker case.)
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from services.launcher import free_port_block
from services.shell.registry import METRICS_ENDPOINTS
from shared.config import TINY_RANDOM_DIR
from shared.models.tiny.builder import ensure_tiny_model
from shared.wire.messages import RequestMsg, SamplingParams
from tests.fault.harness import ReplyLog, poll_metric, scrape, service_processes
from tests.runtime.helpers import greedy, hf_greedy, torch_threads

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_REQUESTS = 12
MAX_TOKENS = 100
SWAP = "baton:num_preemptions_total{mode=swap}"
RECOMPUTE = "baton:num_preemptions_total{mode=recompute}"
SWAP_INS = "baton:num_swap_ins_total"


def prompts() -> list[list[int]]:
    return [[(13 * i + 5 * j) % 400 + 10 for j in range(12 + 2 * i)] for i in range(NUM_REQUESTS)]


async def test_swapped_out_sequences_resume_on_either_worker_with_no_recompute() -> None:
    model_dir = ensure_tiny_model(TINY_RANDOM_DIR, preset="tiny", arch="llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    with torch_threads(1):
        expected = [hf_greedy(hf, p, greedy(MAX_TOKENS, ignore_eos=True)) for p in prompts()]
    big = free_port_block(len(METRICS_ENDPOINTS))  # decode-2's own metrics port block
    with service_processes(start=(), metrics=True) as procs:
        procs.start("decode", env={"BATON_NUM_KV_BLOCKS": "16"})
        procs.start(
            "decode", instance="decode-2",
            env={"BATON_NUM_KV_BLOCKS": "512", "BATON_METRICS_PORT": str(big)},
        )  # fmt: skip
        for name in ("tokenizer", "prefill", "detokenizer"):
            procs.start(name)
        await procs.wait_ready()
        # (A single-service process serves BATON_METRICS_PORT itself, not base + offset.)
        ports = {"decode": procs.metrics_port("decode"), "decode-2": big}
        async with ReplyLog(procs.amqp_url) as log:
            sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            msgs = [
                RequestMsg(f"swap-{i}", sampling, prompt_token_ids=tuple(p))
                for i, p in enumerate(prompts())
            ]
            ids = await log.send(msgs)
            await log.wait(ids, 300)
            for rid, tokens in zip(ids, expected, strict=True):
                assert log.check_stream(rid).token_ids == tokens, rid
        # The counters of the last steps are published with them: wait for the scrape to agree.
        await poll_metric(ports["decode"], SWAP, lambda v: v > 0, timeout_s=30)
        metrics = {name: scrape(port) for name, port in ports.items()}
        swapped_out = sum(m.get(SWAP, 0.0) for m in metrics.values())
        swapped_in = sum(m.get(SWAP_INS, 0.0) for m in metrics.values())
        assert swapped_in == swapped_out > 0  # every swapped-out KV was loaded somewhere
        assert all(m.get(RECOMPUTE, 0.0) == 0 for m in metrics.values()), metrics
        text = procs.tail(100_000)
        assert "swapped out" in text and "swapped in" in text
