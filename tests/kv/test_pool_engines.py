"""The pooled transport between the production engines (``build_prefill_engine`` /
``build_decode_engine``), for what a single connector test cannot show: a prefill that dies
after publishing a handoff but before acking its input has that input redelivered to another
prefill, which sends the request's KV again — and decode, already running the request, gets the
second handoff as a duplicate. The second sender's KV must be given back at once (a release
notice; the spill store's entry deleted), not left pinned until its lease or orphan timeout."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.outputs import AddResult, Handoff, NewRequest
from shared.engine.prefill import PrefillEngine
from tests.runtime.helpers import (
    KV_TRANSPORTS,
    engine_config,
    greedy,
    tiny_model_dir,
    torch_threads,
)

MODEL = tiny_model_dir("llama")


def _handoff(prefill: PrefillEngine, req: NewRequest) -> Handoff:
    assert prefill.add(req) is AddResult.ADDED
    while prefill.has_work():
        for h in prefill.step().handoffs:
            return h
    raise AssertionError("no handoff")


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_a_replayed_handoff_arriving_as_a_duplicate_gives_its_kv_back(
    tmp_path: Path, transport: str
) -> None:
    spill = tmp_path / "spill"

    def config(worker_id: str = "") -> object:
        return engine_config(
            MODEL, 64, kv_transport=transport, spill_dir=str(spill), kv_worker_id=worker_id
        )

    first, second = build_prefill_engine(config("p1")), build_prefill_engine(config("p2"))
    decode = build_decode_engine(config())
    senders = {p.connector.release_route: p for p in (first, second)}
    try:
        with torch_threads(1):
            req = NewRequest("r", list(range(3, 40)), greedy(8, ignore_eos=True))
            h1 = _handoff(first, req)
            running = dataclasses.replace(req, output_token_ids=h1.output_token_ids, kv=h1.kv)
            assert decode.add(running) is AddResult.ADDED
            out = decode.step()  # loads h1's KV and runs
            assert out.transfers and decode.num_running == 1
            # first "died" before acking: its input is replayed by second, which sends again
            h2 = _handoff(second, req)
            assert h2.kv is not None and h2.kv != h1.kv
            replay = dataclasses.replace(req, output_token_ids=h2.output_token_ids, kv=h2.kv)
            assert decode.add(replay) is AddResult.DUPLICATE
            releases = [*out.releases]
            while decode.has_work():
                releases += decode.step().releases
            for notice in releases:
                senders[notice.sender_id].release(notice)
            for p in (first, second):
                p.step()
                assert p.connector.stats().pinned_blocks == 0, p.connector.release_route
                assert not p._handed_off and p.block_manager.num_used_blocks == 0
            assert [n for n in os.listdir(spill) if n.endswith(".kv")] == []
    finally:
        for engine in (decode, first, second):
            engine.connector.close()
