"""Layer-wise KV handoff served end to end (``python -m services up``, real RabbitMQ) over
``mooncake`` on 127.0.0.1: prefill announces each prompt before computing it, decode pulls the
layers as they are written and joins the request to its batch with the first token from the
progress record. Greedy outputs equal transformers'; every request gets one ``done``."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from services.launcher import LocalSystem
from shared.client import BatonClient
from shared.wire.messages import DoneReply
from tests.integration.conftest import running_system
from tests.runtime.helpers import greedy, hf_greedy, tiny_model_dir, torch_threads

pytestmark = pytest.mark.integration

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")


@pytest_asyncio.fixture(scope="module")
async def layerwise() -> AsyncIterator[LocalSystem]:
    env = {
        "BATON_KV_MOONCAKE_HOST": "127.0.0.1",
        "BATON_KV_LAYERWISE": "1",
        "BATON_MAX_NUM_BATCHED_TOKENS": "128",
    }
    async with running_system("mooncake", env, "-layerwise") as system:
        yield system


async def test_layer_wise_handoffs_served_equal_hf(layerwise: LocalSystem) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 40, 150, 400)]
    async with await BatonClient.connect(layerwise.amqp_url, default_wait_s=120) as client:
        replies = await asyncio.gather(
            *(client.generate(prompt_token_ids=p, max_tokens=24, ignore_eos=True) for p in prompts)
        )
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    with torch_threads(1):
        for reply, prompt in zip(replies, prompts, strict=True):
            assert isinstance(reply, DoneReply), reply
            assert reply.token_ids == hf_greedy(hf, prompt, greedy(24, ignore_eos=True))
    log = layerwise.log_path.read_text()
    assert "layer-wise KV did not arrive" not in log and "recomputing" not in log
