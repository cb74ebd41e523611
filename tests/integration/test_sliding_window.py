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

from services.launcher import LocalSystem
from shared.client import BatonClient
from shared.runtime.model_config import ModelConfig
from shared.wire.messages import DoneReply
from tests.integration.conftest import KV_TRANSPORTS, running_system
from tests.runtime.helpers import greedy, hf_greedy, tiny_model_dir, torch_threads

pytestmark = pytest.mark.integration

WINDOW, PROMPT_LEN, MAX_TOKENS, NUM_PROMPTS = 48, 200, 80, 6


@pytest_asyncio.fixture(scope="module", params=KV_TRANSPORTS)
async def windowed(request: pytest.FixtureRequest) -> AsyncIterator[LocalSystem]:
    model = tiny_model_dir("mistral", window=WINDOW)
    assert ModelConfig.from_dir(model).kv_window == WINDOW
    env = {
        "BATON_MODEL": str(model),
        "BATON_KV_CACHE_MB": "16",
        "BATON_MAX_NUM_BATCHED_TOKENS": "128",
    }
    async with running_system(str(request.param), env, f"-window{WINDOW}") as system:
        yield system


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
