"""Layer-wise handoffs through the production engines over ``mooncake`` (loopback TCP): every
prompt is announced before its first forward and pulled layer by layer while prefill computes
it; the tokens equal transformers' greedy ones (chunked prompts, a sliding window, an int8
cache with its full-precision window), and a prompt that ends at prefill, fails there or is
cancelled mid-way leaves nothing pinned or allocated anywhere."""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.engine.outputs import AddResult
from tests.runtime.helpers import EnginePair, greedy, hf_greedy, tiny_model_dir, torch_threads

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")

MOONCAKE = {"kv_mooncake_host": "127.0.0.1"}
PROMPT_LENS = (1, 20, 64, 150, 300)


@pytest.fixture
def make_pair(tmp_path: Path) -> Iterator[Any]:
    made: list[EnginePair] = []

    def make(model: Path, tag: str = "", blocks: int = 128, **kw: Any) -> EnginePair:
        prefill = {**MOONCAKE, "max_num_batched_tokens": 128, **kw}
        pair = EnginePair.build(
            model, tmp_path / tag / "spill", transport="mooncake", prefill=prefill,
            decode={**MOONCAKE, **kw}, prefill_blocks=blocks, decode_blocks=blocks,
        )  # fmt: skip
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


def _prompts(seed: int = 3) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"p{n}": [rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS}


@pytest.mark.parametrize(
    ("arch", "window", "kw"),
    [
        ("llama", None, {}),
        ("mistral", 48, {}),
        # a window holding every token (exact): its slots take 4 blocks a block
        ("llama", None, {"kv_cache_dtype": "int8", "kv_fp_window": 512, "blocks": 640}),
    ],
    ids=["llama", "mistral-w48", "int8-window"],
)
def test_layer_wise_handoffs_give_hf_greedy_tokens(
    make_pair: Any, arch: str, window: int | None, kw: dict[str, Any]
) -> None:
    model = tiny_model_dir(arch, window=window)
    pair = make_pair(model, **kw)
    prompts = _prompts()
    for name, prompt in prompts.items():
        assert pair.add(name, prompt, greedy(40, ignore_eos=True)) is AddResult.ADDED
    pair.run()
    assert all(h.kv is not None and h.kv.payload["layerwise"] for h in pair.handoffs.values())
    assert all(h.output_token_ids == [] for h in pair.handoffs.values())  # sent before computing
    assert len(pair.loads) == len(prompts) and not pair.decode_log.prefills  # pulled, not redone
    assert len(pair.prefill_log.chunks("p300")) >= 3  # chunked while decode pulled
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch_threads(1):
        for name, prompt in prompts.items():
            assert pair.tokens[name] == hf_greedy(hf, prompt, greedy(40, ignore_eos=True)), name
    pair.assert_clean()


def test_off_hands_off_whole_requests(make_pair: Any) -> None:
    pair = make_pair(tiny_model_dir("llama"), kv_layerwise=False)
    pair.add("a", _prompts()["p64"], greedy(8, ignore_eos=True))
    pair.run()
    kv = pair.handoffs["a"].kv
    assert kv is not None and "layerwise" not in kv.payload and len(pair.loads) == 1
    assert len(pair.handoffs["a"].output_token_ids) == 1
    pair.assert_clean()


def test_a_request_ending_at_its_first_token_ends_in_decode_too(make_pair: Any) -> None:
    """Prefill's first token is an EOS (the engines are told so): decode, which announced
    and pulled, drops the request when the record says it ended; nothing is left."""
    model = tiny_model_dir("llama")
    prompt = _prompts()["p20"]
    probe = make_pair(model, "probe")
    probe.add("x", prompt, greedy(4))
    first = probe.run()["x"][0]
    pair = make_pair(model, "eos")
    pair.prefill.stop = dataclasses.replace(pair.prefill.stop, eos_token_ids=frozenset({first}))
    pair.add("x", prompt, greedy(4))
    pair.run()
    assert pair.tokens["x"] == [first] and pair.finish["x"] == "stop"
    assert pair.handoffs["x"].kv is not None and not pair.loads
    pair.assert_clean()


def test_cancelled_or_failed_while_announced_leaves_nothing_behind(make_pair: Any) -> None:
    model = tiny_model_dir("llama")
    prompts = _prompts()
    pair = make_pair(model)
    pair.add("cancelled", prompts["p300"], greedy(8, ignore_eos=True))
    pair.add("ok", prompts["p20"], greedy(8, ignore_eos=True))
    pair.step()  # announced: both handed off before computing anything
    assert (
        set(pair.handoffs) == {"cancelled", "ok"} and pair.prefill.connector.stats().pinned_blocks
    )
    pair.abort("cancelled")
    pair.run()
    assert len(pair.tokens["ok"]) == 8 and not pair.tokens["cancelled"]

    failing = make_pair(model, "failing")
    runner = failing.prefill.runner
    real = runner.prefill_choices
    calls = []

    def fail_second(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args)

    runner.prefill_choices = fail_second  # type: ignore[method-assign]
    failing.add("f", prompts["p300"], greedy(8, ignore_eos=True))  # 3 chunks: the 2nd fails
    failing.run()
    assert "f" in failing.errors and not failing.tokens["f"] and not failing.loads
    for p in (pair, failing):
        p.assert_clean()
