"""The broker node itself SIGKILLed mid-stream and started again (not ``stop_app``): through the
client library and through the HTTP gateway, every stream ends once, whole, with the tokens of an
undisturbed run.

This is the contract's promise for a client whose reply queue is durable and named (the client
library's ``baton.reply.<hex>``, which the gateway uses): the queue and the persistent replies in
it survive the node, and each connection comes back to the restarted node on its own. A single
private node on this machine (tests/multinode/cluster.py), so the main broker stays untouched.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from services.gateway.service import GatewayService
from services.launcher import ServiceProcesses
from shared.client import BatonClient
from shared.config import BatonConfig
from tests.fault.harness import ALL_SERVICES, FAULT_ENV
from tests.multinode.cluster import ClusterNode, cluster_or_skip, listening

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_STREAMS = 8  # each way: the client library, the gateway
MAX_TOKENS = 300
PROMPTS = [[11 + i, 250 + 3 * i, 42, 7 + i, 400 + i] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def node() -> Iterator[ClusterNode]:
    with cluster_or_skip(1) as nodes:
        yield nodes[0]


async def _library_stream(client: BatonClient, prompt: list[int], seen: list[int]) -> list[str]:
    """The reply types, in order; ``seen`` counts this stream's tokens as they come."""
    types = []
    async for reply in client.stream(prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                     ignore_eos=True, wait_s=300):  # fmt: skip
        types.append(reply.type)
        if reply.type == "token":
            seen.append(len(reply.token_ids))
        elif reply.type == "done":
            types.append(json.dumps(list(reply.token_ids)))
    return types


async def _gateway_stream(base: str, prompt: list[int], seen: list[int]) -> tuple[str, str | None]:
    """The streamed completion's text and its finish reason."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    text, finish = "", None
    async with (
        httpx.AsyncClient(timeout=300) as http,
        http.stream("POST", f"{base}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            seen.append(1)
            finish = choice.get("finish_reason") or finish
    return text, finish


async def test_the_broker_node_killed_and_restarted_loses_nothing(node: ClusterNode) -> None:
    procs = ServiceProcesses(node.url, env=FAULT_ENV)
    for name in ALL_SERVICES:
        procs.start(name)
    gateway = GatewayService(BatonConfig.from_env().replace(amqp_url=node.url, gateway_port=0))
    try:
        await procs.wait_ready()
        await gateway.start()
        base = f"http://127.0.0.1:{gateway.port}"
        async with await BatonClient.connect(node.url) as client:
            want = []
            for prompt in PROMPTS:  # the undisturbed run: token ids and text
                done = await client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                             ignore_eos=True, wait_s=300)  # fmt: skip
                assert done.type == "done", done
                want.append((list(done.token_ids), done.text))

            lib_seen: list[list[int]] = [[] for _ in PROMPTS]
            gw_seen: list[list[int]] = [[] for _ in PROMPTS]
            lib = [asyncio.create_task(_library_stream(client, p, s))
                   for p, s in zip(PROMPTS, lib_seen, strict=True)]  # fmt: skip
            gw = [asyncio.create_task(_gateway_stream(base, p, s))
                  for p, s in zip(PROMPTS, gw_seen, strict=True)]  # fmt: skip
            # Every stream under way: ten tokens into each library stream, and past its first
            # event into each gateway stream (whose events carry ~50 ms of tokens each).
            while min(sum(s) for s in lib_seen) < 10 or min(len(s) for s in gw_seen) < 2:
                assert not any(t.done() for t in lib + gw), "a stream ended before the fault"
                await asyncio.sleep(0.05)
            in_flight = sum(not t.done() for t in lib + gw)
            assert in_flight >= NUM_STREAMS, f"only {in_flight} streams in flight at the kill"
            await asyncio.to_thread(node.kill)
            assert not listening(node.port)
            await asyncio.sleep(2)  # every connection notices the loss
            node.start()
            assert await asyncio.to_thread(node.wait_listening), "the node did not start again"

            lib_out = await asyncio.wait_for(asyncio.gather(*lib), 300)
            gw_out = await asyncio.wait_for(asyncio.gather(*gw), 300)
    finally:
        await gateway.stop()
        procs.stop()
    for types, (ids, _) in zip(lib_out, want, strict=True):
        assert types.count("done") == 1 and "error" not in types, types[-3:]
        assert types[-2:] == ["done", json.dumps(ids)]  # whole, and the undisturbed tokens
    for (text, finish), (_, want_text) in zip(gw_out, want, strict=True):
        assert (finish, text) == ("length", want_text)
