"""A transport that cannot work where it is configured fails loudly at start, and falls back to
the spill store only when asked to (``BATON_KV_FALLBACK=spill``), every such handoff counted.

On this CPU-only machine ``cuda-ipc`` cannot work: ``python -m services prefill`` must exit
non-zero before serving, naming CUDA; with the fallback the engines hand off through the spill
store (same tokens as ``shm``), and a live prefill counts ``baton:kv_handoff_fallbacks_total``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aio_pika
import pytest
import torch

from shared.config import REPO_ROOT
from shared.wire.messages import HandoffMsg, PrefillMsg
from shared.wire.queues import DECODE_QUEUE, PREFILL_QUEUE
from shared.wire.sampling import SamplingParams
from tests.fault.harness import poll_metric, service_processes
from tests.runtime.helpers import EnginePair, greedy, tiny_model_dir

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")

FALLBACK_LOG = ("fell back to the spill store", "using the spill store")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    return {
        **env,
        "BATON_KV_TRANSPORT": "cuda-ipc",
        "BATON_SPILL_DIR": str(tmp_path / "spill"),
        # Nothing listens there: a prefill that got past its start-up check would hang
        # reconnecting (and fail this test's timeout) instead of exiting at once.
        "BATON_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
        "BATON_METRICS_PORT": "0",
        "BATON_LOG_FORMAT": "json",
        **extra,
    }


def test_cuda_ipc_prefill_exits_at_start_naming_cuda(tmp_path: Path) -> None:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "services", "prefill"],
        cwd=REPO_ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "BATON_KV_TRANSPORT=cuda-ipc needs CUDA" in done.stderr, done.stderr[-2000:]
    assert "BATON_KV_FALLBACK=spill" in done.stderr  # the way out is named too
    assert not any(s in done.stdout + done.stderr for s in FALLBACK_LOG)  # no silent fallback
    spill = tmp_path / "spill"
    assert not spill.exists() or list(spill.iterdir()) == []  # no pool, no spill entry
    assert time.monotonic() - t0 < 60  # at start, not after reconnecting to a broker


def test_no_fallback_without_the_flag_and_a_counted_one_with_it(tmp_path: Path) -> None:
    """Core level (``build_prefill_engine``/``build_decode_engine``): cuda-ipc refuses to build;
    with ``kv_fallback=spill`` both engines use the spill store and every handoff is counted."""
    model = tiny_model_dir("llama")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        EnginePair.build(model, tmp_path / "refused", transport="cuda-ipc")
    assert not (tmp_path / "refused").exists()  # nothing made before the refusal

    prompts = {"a": list(range(3, 43)), "b": list(range(50, 55))}
    results = {}
    for transport, fallback in (("shm", {}), ("cuda-ipc", {"kv_fallback": "spill"})):
        with EnginePair.build(
            model, tmp_path / transport, transport=transport, prefill=fallback, decode=fallback
        ) as pair:
            for rid, prompt in prompts.items():
                pair.add(rid, prompt, greedy(6, ignore_eos=True))
            results[transport] = pair.run()
            assert {h.kv.transport for h in pair.handoffs.values() if h.kv} == {"shm"}
            assert len(pair.loads) == len(prompts)
            fallbacks = pair.prefill.connector.stats().fallbacks
            assert fallbacks == (len(prompts) if fallback else 0)
            pair.assert_clean()
    assert results["cuda-ipc"] == results["shm"]


@pytest.mark.integration
async def test_live_prefill_with_fallback_serves_and_counts_it() -> None:
    """A real ``python -m services prefill`` with ``BATON_KV_TRANSPORT=cuda-ipc`` and
    ``BATON_KV_FALLBACK=spill``: it starts, hands a request off through the spill store, and
    ``baton:kv_handoff_fallbacks_total`` counts it on its /metrics."""
    env = {"BATON_KV_TRANSPORT": "cuda-ipc", "BATON_KV_FALLBACK": "spill"}
    with service_processes(env, start=("prefill",), metrics=True) as procs:
        port = procs.metrics_port("prefill")
        await poll_metric(port, "baton:kv_handoff_fallbacks_total", lambda v: v == 0, 90, 0.2)
        connection = await aio_pika.connect_robust(procs.amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            msg = PrefillMsg(
                request_id="fallback-1",
                reply_to="nobody",
                prompt_token_ids=list(range(3, 40)),
                sampling=SamplingParams(max_tokens=4, ignore_eos=True),
                arrival_time=time.time(),
            )
            await channel.default_exchange.publish(
                aio_pika.Message(msg.encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=PREFILL_QUEUE,
            )
            await poll_metric(port, "baton:kv_handoff_fallbacks_total", lambda v: v == 1, 30)
            queue = await channel.declare_queue(DECODE_QUEUE, passive=True)
            delivery = None
            for _ in range(50):
                delivery = await queue.get(fail=False)
                if delivery is not None:
                    break
                await asyncio.sleep(0.1)
            assert delivery is not None
            handoff = HandoffMsg.decode(delivery.body, 1 << 20)
        assert handoff.request_id == "fallback-1"
        assert handoff.kv is not None and handoff.kv.transport == "shm"  # any decode reads it
        assert any(s in procs.tail(200) for s in FALLBACK_LOG)
