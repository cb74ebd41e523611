"""vLLM's sampling fields end to end on the tiny model, against HF ``generate`` with the same
settings: prefill picks the first token and decode the rest, so both engines must apply them
alike for the tokens to agree."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.shell.common import resolve_model_dir
from shared.client import BatonClient
from shared.config import BatonConfig
from shared.wire.messages import DoneReply, ErrorReply, TokenReply
from tests.runtime.helpers import greedy, hf_greedy

pytestmark = pytest.mark.integration

PROMPT = "hello hello hello"  # greedy repeats itself on the tiny model: penalties show
MAX_NEW = 16


@cache
def _model() -> Any:
    model_dir = str(resolve_model_dir(BatonConfig.from_env()))
    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    )


def _hf_greedy(prompt_ids: list[int], stop_ids: tuple[int, ...] = (), **kw: Any) -> list[int]:
    _, model = _model()
    eos = [*model.generation_config.eos_token_id, *stop_ids]
    return hf_greedy(model, prompt_ids, greedy(MAX_NEW), eos_token_id=eos, **kw)


async def _greedy(client: BatonClient, **kw: Any) -> DoneReply:
    reply = await client.generate(PROMPT, max_tokens=MAX_NEW, **kw)
    assert isinstance(reply, DoneReply), reply
    return reply


async def test_repetition_penalty_equals_hfs(client: BatonClient) -> None:
    tok, _ = _model()
    ids = tok.encode(PROMPT)
    plain = await _greedy(client)
    assert plain.token_ids == _hf_greedy(ids)
    for penalty in (1.5, 0.8):
        penalised = await _greedy(client, repetition_penalty=penalty)
        assert penalised.token_ids == _hf_greedy(ids, repetition_penalty=penalty)
    assert (await _greedy(client, repetition_penalty=1.5)).token_ids != plain.token_ids


async def test_stop_token_ids_and_min_tokens(client: BatonClient) -> None:
    tok, _ = _model()
    ids = tok.encode(PROMPT)
    plain = await _greedy(client)
    stop = plain.token_ids[1]  # the second token: a stop there ends the output at two tokens
    stopped = await _greedy(client, stop_token_ids=[stop])
    assert stopped.finish_reason == "stop" and stopped.token_ids == plain.token_ids[:2]
    assert stopped.text == tok.decode(plain.token_ids[:1], skip_special_tokens=True)
    kept = await _greedy(client, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept.token_ids == stopped.token_ids
    assert kept.text == tok.decode(plain.token_ids[:2], skip_special_tokens=True)
    # min_tokens: the stop token (and EOS) cannot come before four outputs, as HF's
    # min_new_tokens with the stop id among its EOS ids.
    late = await _greedy(client, stop_token_ids=[stop], min_tokens=4)
    assert late.token_ids == _hf_greedy(ids, (stop,), min_new_tokens=4)
    assert len(late.token_ids) > 2 and stop not in late.token_ids[:4]


async def test_streamed_text_hides_the_stop_token(client: BatonClient) -> None:
    plain = await _greedy(client)
    stop = plain.token_ids[3]
    replies = [r async for r in client.stream(PROMPT, max_tokens=MAX_NEW, stop_token_ids=[stop])]
    *tokens, done = replies
    assert isinstance(done, DoneReply) and done.finish_reason == "stop"
    assert all(isinstance(t, TokenReply) for t in tokens)
    assert "".join(t.text for t in tokens) == done.text  # type: ignore[union-attr]
    assert [i for t in tokens for i in t.token_ids] == done.token_ids  # type: ignore[union-attr]


async def test_stop_string_kept_with_include_stop_str_in_output(client: BatonClient) -> None:
    plain = await _greedy(client)
    stop = plain.text[len(plain.text) // 2 :][:3]
    assert stop.strip()
    cut = await _greedy(client, stop=[stop])
    kept = await _greedy(client, stop=[stop], include_stop_str_in_output=True)
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and plain.text.startswith(kept.text)


async def test_out_of_vocabulary_stop_token_is_refused(client: BatonClient) -> None:
    reply = await client.generate(PROMPT, max_tokens=4, stop_token_ids=[10**9])
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_request"
    assert reply.message.startswith("stop_token_ids contains 1000000000")
