"""Parallel sampling (``n`` > 1) in the engines, no broker: one prefill samples every choice's
first token from the prompt's one row of logits; decode forks the prompt's KV into a sequence per
choice on shared blocks (ref counts), each with its own copy of the partly filled last block;
every block comes back at the end, and aborts and preemption free every choice's blocks.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.engine.inputs import choice_key
from shared.runtime.sequence import Sequence
from shared.wire.sampling import SamplingParams
from tests.runtime.helpers import EnginePair, greedy, hf_greedy, tiny_model_dir, torch_threads

MODEL = tiny_model_dir("llama")
BLOCK = 16
PROMPT = [random.Random(7).randrange(3, 512) for _ in range(2 * BLOCK + 5)]  # 2 full blocks
MAX_TOKENS = 8


def with_n(sampling: SamplingParams, n: int) -> SamplingParams:
    return dataclasses.replace(sampling, n=n)


def seeded(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)


def choices(pair: EnginePair, rid: str) -> list[list[int]]:
    return [pair.tokens[name] for name in pair.names(rid)]


def forked(pair: EnginePair, rid: str, n: int) -> list[Sequence]:
    """Step until decode runs every choice of ``rid``; those sequences."""
    keys = [choice_key(rid, i) for i in range(n)]
    with torch_threads(1):
        for _ in range(50):
            pair.step()
            if all(k in pair.decode.scheduler.running for k in keys):
                return [pair.decode.requests[k] for k in keys]
    raise AssertionError(f"{rid} was not forked into {n} running choices")


@pytest.fixture(scope="module")
def hf() -> Iterator[Any]:
    yield AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def test_greedy_choices_share_the_prompt_and_equal_n1_and_hf(tmp_path: Path, hf: Any) -> None:
    pair = EnginePair.build(MODEL, tmp_path / "spill")
    params = greedy(MAX_TOKENS, ignore_eos=True)
    pair.add("four", PROMPT, with_n(params, 4))
    seqs = forked(pair, "four", 4)
    bm = pair.decode.block_manager
    shared = seqs[0].block_table[:2]  # the prompt's full blocks: one copy, four references
    assert all(s.block_table[:2] == shared for s in seqs)
    assert [bm.ref_count(b) for b in shared] == [4, 4]
    own = [s.block_table[2] for s in seqs]  # the partly filled block: each its own
    assert len(set(own)) == 4 and all(bm.ref_count(b) == 1 for b in own)
    pair.run()
    pair.assert_clean()  # every block back: shared ones once their last choice ended
    assert [rid for call in pair.prefill_log.prefills for rid, *_ in call] == ["four"]
    assert not pair.decode_log.prefills  # loaded once, forked: nothing recomputed

    pair.add("one", PROMPT, params)
    pair.add("two", PROMPT, with_n(params, 2))
    pair.run()
    expected = hf_greedy(hf, PROMPT, params)
    assert pair.tokens["one"] == expected
    assert choices(pair, "four") == [expected] * 4 and choices(pair, "two") == [expected] * 2
    pair.assert_clean()


def test_seeded_choices_differ_and_replay_alike(tmp_path: Path) -> None:
    runs = []
    for run in range(2):
        pair = EnginePair.build(MODEL, tmp_path / f"spill-{run}")
        pair.add("one", PROMPT, seeded(1234))
        pair.add("four", PROMPT, seeded(1234, n=4))
        pair.run()
        pair.assert_clean()
        runs.append((pair.tokens["one"], choices(pair, "four")))
    (one, four), again = runs
    assert len({tuple(c) for c in four}) == 4  # the index is mixed into each choice's seed
    assert runs[1] == (one, four) == again
    assert four[0] == one  # choice 0 samples as a request with n = 1


@pytest.mark.parametrize(
    "decode",
    [
        {"decode_blocks": 8},  # swapped out: a choice travels alone and comes back
        {"decode_blocks": 8, "decode": {"decode_preemption": "recompute"}},
        {"decode": {"max_num_seqs": 2}},  # no seat at the fork: choices wait and recompute
        {"spill_max_bytes": 1},  # no KV handed off: decode recomputes the prompt, then forks
    ],
    ids=["swap", "recompute", "no-seat", "no-kv"],
)
def test_choices_under_pressure_match_a_relaxed_run(tmp_path: Path, decode: dict[str, Any]) -> None:
    params = dataclasses.replace(seeded(99, n=4), max_tokens=40)  # 4 x 5 blocks: 8 do not hold
    relaxed = EnginePair.build(MODEL, tmp_path / "relaxed")
    relaxed.add("r", PROMPT, params)
    relaxed.run()
    pair = EnginePair.build(MODEL, tmp_path / "tight", **decode)
    pair.add("r", PROMPT, params)
    pair.run()
    s = pair.decode.scheduler
    assert s.num_swaps + s.num_preemptions > 0 or pair.decode_log.prefills  # it was tight
    assert pair.tokens == relaxed.tokens and len({tuple(t) for t in pair.tokens.values()}) == 4
    pair.assert_clean()


def test_aborts_free_every_choice(tmp_path: Path) -> None:
    pair = EnginePair.build(MODEL, tmp_path / "spill")
    params = greedy(30, ignore_eos=True)
    pair.add("all", PROMPT, with_n(params, 3))
    pair.add("some", [t + 1 for t in PROMPT], with_n(params, 3))
    forked(pair, "all", 3)
    forked(pair, "some", 3)
    decode = pair.decode
    assert decode.abort("some", 1) == []  # one choice (a stop string): the others go on
    assert choice_key("some", 1) not in decode.requests
    pair.aborted.add("some/1")
    assert decode.abort("all") == ["all"]  # the whole request: its one input is over
    pair.aborted.update(pair.names("all"))
    assert not any(s.parent_request_id == "all" for s in decode.requests.values())
    pair.run()
    assert pair.finish == {"some/0": "length", "some/2": "length"}
    pair.assert_clean()


def test_a_choice_that_ends_at_its_first_token_is_not_forked(tmp_path: Path) -> None:
    params = dataclasses.replace(seeded(5, n=4), temperature=50.0)  # near uniform: apart
    first = EnginePair.build(MODEL, tmp_path / "first")
    first.add("r", PROMPT, params)
    first.run()
    firsts = [t[0] for t in choices(first, "r")]
    stop = firsts[1]
    assert firsts.count(stop) == 1
    pair = EnginePair.build(MODEL, tmp_path / "spill")
    pair.add("r", PROMPT, dataclasses.replace(params, stop_token_ids=(stop,)))
    pair.run()
    handoff = pair.handoffs["r"]
    assert handoff.output_token_ids == [] and stop not in [t for _, t in handoff.choices]
    assert [i for i, _ in handoff.choices] == [i for i, t in enumerate(firsts) if t != stop]
    assert pair.tokens["r/1"] == [stop] and pair.finish["r/1"] == "stop"
    pair.assert_clean()


def test_the_first_choice_aborted_before_the_fork_still_serves_the_others(tmp_path: Path) -> None:
    pair = EnginePair.build(MODEL, tmp_path / "spill")
    pair.add("r", PROMPT, with_n(greedy(6, ignore_eos=True), 3))
    with torch_threads(1):  # prefill alone: decode has the handoff, not a step yet
        while pair.prefill.has_work():
            out = pair.prefill.step()
            pair.collect(out, prefill=True)
            for h in out.handoffs:
                pair.handoffs[h.request_id] = h
                pair.decode.add(pair.to_decode(h))
    assert choice_key("r", 0) in pair.decode.requests  # the first choice, not forked yet
    assert pair.decode.abort("r", 0) == []  # its KV is still to be shared
    pair.aborted.add("r/0")
    pair.run()
    assert pair.tokens["r/0"] == pair.tokens["r/0"][:1]  # prefill's first token, then nothing
    assert pair.finish == {"r/1": "length", "r/2": "length"}
    assert pair.tokens["r/1"] == pair.tokens["r/2"] and len(pair.tokens["r/1"]) == 6
    pair.assert_clean()


@pytest.mark.parametrize(
    "config",
    [
        # int8 KV with a full-precision window: the window's slots are shared and copied too
        {"kv_cache_dtype": "int8", "kv_fp_window": 32},
        {"kv_host_cache_mb": 1},  # 6 device blocks: the choices' blocks spill to the host tier
    ],
    ids=["int8-window", "host-tier"],
)
def test_forks_on_every_cache_layout_equal_n1(tmp_path: Path, config: dict[str, Any]) -> None:
    params = greedy(24, ignore_eos=True)
    prefill = {k: v for k, v in config.items() if k != "kv_host_cache_mb"}
    blocks = 6 if "kv_host_cache_mb" in config else 128
    pair = EnginePair.build(
        MODEL, tmp_path / "spill", prefill=prefill, decode=config, decode_blocks=blocks
    )
    pair.add("one", PROMPT, params)
    pair.run()
    pair.add("three", PROMPT, with_n(params, 3))
    pair.run()
    assert choices(pair, "three") == [pair.tokens["one"]] * 3
    pair.assert_clean()
