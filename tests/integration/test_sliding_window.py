"""A Mistral model whose sliding window (48 tokens) is shorter than its prompts (200 tokens) and
its generations (80 tokens), served end to end (``python -m services up``, real RabbitMQ) over
each CPU KV transport: every completion equals transformers' greedy output token for token.

Prefill chunks the prompts (a 128-token budget), releases the blocks that fall out of the
window and hands off only the window's blocks; decode releases blocks as the window slides."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from services.launcher import LocalSystem, free_port_block, fresh_vhost
from services.shell.registry import METRICS_ENDPOINTS
from shared.client import BatonClient
from shared.runtime.model_config import ModelConfig
from shared.wire.messages import DoneReply
from tests.integration.conftest import KV_TRANSPORTS
from tests.runtime.helpers import greedy, hf_greedy, tiny_model_dir, torch_threads

pytestmark = pytest.mark.integration

WINDOW, PROMPT_LEN, MAX_TOKENS, NUM_PROMPTS = 48, 200, 80, 6


@pytest_asyncio.fixture(scope="module", params=KV_TRANSPORTS)
async def windowed(request: pytest.FixtureRequest) -> AsyncIterator[LocalSystem]:
    transport = str(request.param)
    model = tiny_model_dir("mistral", window=WINDOW)
    assert ModelConfig.from_dir(model).kv_window == WINDOW
    with fresh_vhost(prefix=f"baton-test-window-{transport}") as url:
        env = {
            "BATON_MODEL": str(model),
            "BATON_KV_CACHE_MB": "16",
            "BATON_MAX_NUM_BATCHED_TOKENS": "128",
            "BATON_METRICS_PORT": str(free_port_block(len(METRICS_ENDPOINTS))),
            "BATON_KV_TRANSPORT": transport,
        }
        system = LocalSystem(url, env=env)
        system.start()
        try:
            await system.wait_ready()
            yield system
        finally:
            code = system.stop()
            print(f"baton ({transport}, window {WINDOW}) exited with {code}: {system.log_path}")


async def test_window_shorter_than_prompt_and_generation_equals_hf(
    windowed: LocalSystem,
) -> None:
    rng = random.Random(48)
    prompts = [[rng.randrange(3, 512) for _ in range(PROMPT_LEN)] for _ in range(NUM_PROMPTS)]
    async with await BatonClient.connect(windowed.amqp_url, default_wait_s=120) as client:
        replies = await asyncio.gather(
            *(
                client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                for p in prompts
            )
        )
    model = tiny_model_dir("mistral", window=WINDOW)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch_threads(1):
        expected = [hf_greedy(hf, p, greedy(MAX_TOKENS, ignore_eos=True)) for p in prompts]
    for reply, want in zip(replies, expected, strict=True):
        assert isinstance(reply, DoneReply), reply
        assert reply.token_ids == want
        assert reply.usage["prompt_tokens"] == PROMPT_LEN
