"""A forward that raises ends the requests of that batch with ``internal`` and nothing else:
the decode service keeps serving. Decode runs in this process so the test can make its real
model runner fail once; the other three services are real processes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.shell.registry import build
from shared.client import BatonClient
from shared.wire.messages import DoneReply, ErrorReply
from tests.fault.harness import service_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_decode_service_survives_a_failed_step() -> None:
    with service_processes(start=("tokenizer", "prefill", "detokenizer")) as procs:
        decode: Any = build("decode", procs.config())
        real_decode = decode.engine.runner.decode
        failures = 0

        def fail_once(seqs: Any, *args: Any) -> Any:
            nonlocal failures
            if failures == 0:
                failures += 1
                raise RuntimeError("injected fault")
            return real_decode(seqs, *args)

        decode.engine.runner.decode = fail_once
        await decode.start()
        try:
            await procs.wait_ready()  # its probe request is the one that meets the fault
            assert failures == 1
            async with await BatonClient.connect(procs.amqp_url) as client:
                ok = await client.generate("after the fault", max_tokens=8, ignore_eos=True)
                assert isinstance(ok, DoneReply) and len(ok.token_ids) == 8
            engine = decode.engine
            assert not decode.inflight and not engine.requests and not engine.has_work()
            assert engine.block_manager.num_used_blocks == 0
        finally:
            await decode.stop()


async def test_requests_of_a_failed_step_get_internal_error() -> None:
    """With every step failing, a request is answered `internal` (not left hanging)."""
    with service_processes() as procs:
        await procs.wait_ready()
        procs.kill("decode")
        decode: Any = build("decode", procs.config())

        def always_fail(seqs: Any, *args: Any) -> Any:
            raise RuntimeError("injected fault")

        decode.engine.runner.decode = always_fail
        await decode.start()
        try:
            async with await BatonClient.connect(procs.amqp_url) as client:
                reply = await asyncio.wait_for(
                    client.generate("doomed", max_tokens=8, ignore_eos=True), 60
                )
            assert isinstance(reply, ErrorReply) and reply.code == "internal"
            assert "decode failed" in reply.message
        finally:
            await decode.stop()
