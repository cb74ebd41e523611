"""The engine core without a broker: the verbs' results, aborts, deadlines, failing forwards,
requests that end at their first token, sequences ending at the cache's length, no leaked blocks.

Both engines are the production ones on the tiny llama, wired by ``EnginePair`` (plumbing that
moves handoffs and releases between them); some tests drive one engine's ``step`` directly.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared.engine.outputs import AddResult, Handoff, NewRequest
from shared.runtime import ModelRunner
from shared.wire.errors import ErrorCode
from shared.wire.messages import KVDescriptor
from shared.wire.sampling import SamplingParams
from tests.runtime.helpers import EnginePair, assert_idle, greedy, tiny_model_dir, torch_threads

MODEL = tiny_model_dir("llama")


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def make_pair(tmp_path: Path, **kw: Any) -> EnginePair:
    return EnginePair.build(MODEL, tmp_path / "spill", **kw)


def spilled(pair: EnginePair) -> list[str]:
    return os.listdir(pair.spill_dir)


def prefill_only(pair: EnginePair) -> dict[str, Handoff]:
    """Step prefill alone until idle; its handoffs, not delivered to decode."""
    handoffs: dict[str, Handoff] = {}
    with torch_threads(1):
        while pair.prefill.has_work():
            out = pair.prefill.step()
            pair.collect(out)
            handoffs.update((h.request_id, h) for h in out.handoffs)
    return handoffs


def fail_once(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner, name: str) -> Callable[[], int]:
    """The runner's ``name`` forward raises on its next call, then works; returns a counter."""
    real = getattr(runner, name)
    calls = [0]

    def forward(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("device lost")
        return real(*args)

    monkeypatch.setattr(runner, name, forward)
    return lambda: calls[0]


# --- add --------------------------------------------------------------------------------------


def test_add_results(tmp_path: Path) -> None:
    pair = make_pair(tmp_path, prefill_blocks=4)  # 64 tokens of cache: max_model_len 64
    p = pair.prefill
    assert p.limits.max_model_len == 64
    assert pair.add("a", prompt(10), greedy(4)) is AddResult.ADDED
    assert pair.add("a", prompt(10), greedy(4)) is AddResult.DUPLICATE
    assert not p.abort("cancelled")  # not here; a later copy is refused all the same
    assert pair.add("cancelled", prompt(10), greedy(4)) is AddResult.STALE
    now = time.time()
    assert pair.add("late", prompt(10), greedy(4), deadline=now - 1) is AddResult.STALE
    assert pair.add("in-time", prompt(10), greedy(4), deadline=now + 60) is AddResult.ADDED
    assert pair.add("huge", prompt(64), greedy(4)) is AddResult.TOO_LONG
    assert pair.add("fits", prompt(63), greedy(4)) is AddResult.ADDED  # one token of room
    assert p.num_waiting == 3 and p.requests.keys() == {"a", "in-time", "fits"}
    pair.run()
    assert pair.finish == {"a": "length", "in-time": "length", "fits": "length"}
    assert [len(pair.tokens[r]) for r in ("a", "in-time", "fits")] == [4, 4, 1]
    assert "fits" not in pair.handoffs  # its first token filled max_model_len: it ended at prefill
    pair.assert_clean()


def test_decode_add_results_and_the_descriptors_they_leave(tmp_path: Path) -> None:
    """A refused copy's KV is dropped at once; a duplicate's is its original's and is kept."""
    pair = make_pair(tmp_path, decode_blocks=4)  # decode: max_model_len 64
    d = pair.decode
    for rid, n in (("dup", 20), ("aborted", 20), ("expired", 20), ("too-long", 63)):
        pair.add(rid, prompt(n), greedy(8, ignore_eos=True))
    handoffs = prefill_only(pair)
    assert handoffs.keys() == pair.requests.keys()
    assert all(h.kv is not None for h in handoffs.values()) and len(spilled(pair)) == 4

    def to_decode(rid: str, **kw: Any) -> AddResult:
        h = handoffs[rid]
        req = dataclasses.replace(
            pair.requests[rid], output_token_ids=h.output_token_ids, kv=h.kv, **kw
        )
        return d.add(req)

    assert to_decode("dup") is AddResult.ADDED
    assert to_decode("dup") is AddResult.DUPLICATE
    assert not d.abort("aborted")
    assert to_decode("aborted") is AddResult.STALE
    assert to_decode("expired", deadline=time.time() - 1) is AddResult.STALE
    assert to_decode("too-long") is AddResult.TOO_LONG  # 63 + 1 tokens: no room in decode
    assert len(spilled(pair)) == 1  # only dup's entry is left, for dup to load
    for rid in ("aborted", "expired", "too-long"):
        pair.aborted.add(rid)  # the shell answers these; nothing more comes from the engines
    pair.run()
    assert pair.finish == {"dup": "length"} and len(pair.tokens["dup"]) == 8
    assert not pair.decode_log.prefills  # dup's KV was loaded, not recomputed
    pair.assert_clean()


# --- abort ------------------------------------------------------------------------------------


def test_abort_frees_blocks_wherever_the_request_is(tmp_path: Path) -> None:
    pair = make_pair(
        tmp_path,
        prefill={"max_num_batched_tokens": 16},  # 40-token prompts take 3 steps
        decode={"max_num_seqs": 1},  # a second handoff waits in decode, its KV unloaded
    )
    for rid in ("decoding", "waiting-in-decode", "mid-prompt", "waiting-in-prefill"):
        pair.add(rid, prompt(40, seed=len(rid)), greedy(30, ignore_eos=True))
    with torch_threads(1):
        while "waiting-in-decode" not in pair.decode.requests:
            pair.step()
        pair.step()
    assert pair.decode.num_running == 1 and pair.decode.num_waiting == 1
    assert "mid-prompt" in pair.prefill.scheduler.running  # partly computed, holding blocks
    assert "waiting-in-prefill" in pair.prefill.scheduler.waiting
    assert len(spilled(pair)) == 1  # the waiting handoff's KV
    for rid in ("decoding", "waiting-in-decode", "mid-prompt", "waiting-in-prefill"):
        assert pair.abort(rid)
        assert not pair.abort(rid)  # gone
    assert spilled(pair) == []
    assert_idle(pair.prefill)
    assert_idle(pair.decode)
    assert pair.add("mid-prompt", prompt(40), greedy(4)) is AddResult.STALE  # a late copy
    pair.run()  # nothing more comes out for them
    assert not pair.finish and not pair.errors
    pair.assert_clean()


# --- deadlines --------------------------------------------------------------------------------


def test_deadline_expiry_retires_silently(tmp_path: Path) -> None:
    pair = make_pair(tmp_path, prefill={"max_num_batched_tokens": 16})
    deadline = time.time() + 100
    pair.add("decoding", prompt(8, seed=2), greedy(50, ignore_eos=True), deadline=deadline + 1)
    pair.add("no-deadline", prompt(8, seed=3), greedy(20, ignore_eos=True))
    pair.add("long-prompt", prompt(40), greedy(4), deadline=deadline)
    pair.add("queued", prompt(40, seed=1), greedy(4), deadline=deadline)
    with torch_threads(1):
        while "long-prompt" not in pair.prefill.scheduler.running:
            pair.step()
        assert "decoding" in pair.decode.requests and "queued" in pair.prefill.scheduler.waiting
        out = pair.prefill.step(now=deadline)  # both prompts expire, in the middle or queued
        assert sorted(out.retired) == ["long-prompt", "queued"]
        assert not out.tokens and not out.errors and not out.handoffs
        pair.collect(out)
        assert not pair.prefill.has_work()
        assert_idle(pair.prefill)
        assert pair.decode.has_work()
        out = pair.decode.step(now=deadline + 1)
    assert "decoding" in out.retired and not out.errors
    assert all(t.request_id != "decoding" for t in out.tokens)
    assert "decoding" not in pair.decode.requests
    pair.collect(out)
    pair.run()
    assert pair.expired == {"long-prompt", "queued", "decoding"}  # the detokenizer answers
    assert pair.finish == {"no-deadline": "length"} and len(pair.tokens["no-deadline"]) == 20
    pair.assert_clean()


# --- failures ---------------------------------------------------------------------------------


def with_abc(pair: EnginePair) -> EnginePair:
    """``pair`` given requests a, b and c: 12-token prompts, 6 greedy tokens each."""
    for i, rid in enumerate("abc", 1):
        pair.add(rid, prompt(12, seed=i), greedy(6, ignore_eos=True))
    return pair


def finishes_as(pair: EnginePair, expected: dict[str, list[int]]) -> None:
    """The rest of ``pair``'s run ends with an undisturbed run's tokens: nobody failed, and
    nothing is left behind."""
    pair.run()
    assert pair.tokens == expected and not pair.errors
    pair.assert_clean()


def test_a_prefill_forward_that_fails_once_fails_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch raises once; its halves, run again alone, succeed: nobody is failed, and the
    tokens are those of an undisturbed run (isolation: shared/engine/engine.py)."""
    expected = with_abc(make_pair(tmp_path / "ref")).run()
    pair = with_abc(make_pair(tmp_path, prefill={"prefill_max_num_seqs": 2}))
    calls = fail_once(monkeypatch, pair.prefill.runner, "prefill_choices")
    with torch_threads(1):
        out, _ = pair.step()
    assert calls() == 3  # the batch of two, then each alone
    assert out is not None and not out.errors
    assert sorted(t.request_id for t in out.tokens) == ["a", "b"]
    finishes_as(pair, expected)


def test_a_decode_forward_that_fails_once_fails_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = with_abc(make_pair(tmp_path / "ref")).run()
    pair = with_abc(make_pair(tmp_path, decode={"max_num_seqs": 2}))
    with torch_threads(1):
        p_out, _ = pair.step()  # prefill hands all three off; decode admits a and b
        assert p_out is not None and len(p_out.handoffs) == 3
        assert pair.decode.num_running == 2 and pair.decode.num_waiting == 1
        fail_once(monkeypatch, pair.decode.runner, "decode")
        out = pair.decode.step()
    assert not out.errors and len(out.tokens) == 2
    pair.collect(out)
    finishes_as(pair, expected)


def test_a_failing_recompute_in_decode_fails_only_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = make_pair(tmp_path, spill_max_bytes=0)  # every handoff without KV: decode recomputes
    fail_once(monkeypatch, pair.decode.runner, "prefill")
    pair.add("a", prompt(20, seed=1), greedy(5, ignore_eos=True))
    pair.run()
    assert pair.handoffs["a"].kv is None
    assert pair.errors["a"].code is ErrorCode.INTERNAL and "a" not in pair.finish
    pair.add("b", prompt(20, seed=2), greedy(5, ignore_eos=True))
    pair.run()
    assert pair.finish == {"b": "length"} and len(pair.tokens["b"]) == 5
    pair.assert_clean()


def test_prefill_reclaims_its_own_unclaimed_entries_when_no_decode_takes_them(
    tmp_path: Path,
) -> None:
    """Decode is gone (its handoffs are never taken): prefill's own sweep deletes the spill
    entries it wrote once they are older than BATON_SPILL_ORPHAN_TIMEOUT_S, and counts them."""
    timeout = {"spill_orphan_timeout_s": 4.0}
    pair = make_pair(tmp_path, prefill=timeout, decode=timeout)
    for i in range(3):
        pair.add(f"r{i}", prompt(12, seed=i), greedy(6, ignore_eos=True))
    handoffs = prefill_only(pair)
    assert len(handoffs) == 3 and len(spilled(pair)) == 3
    later = time.time() + 10
    with torch_threads(1):
        pair.prefill.step(later)
    assert spilled(pair) == []
    assert pair.prefill.kv_reclaimed() == {("spill_entries", "unclaimed"): 3}
    for h in handoffs.values():  # a decode that comes back finds the KV gone: recompute
        assert h.kv is not None and not pair.decode.connector.load(h.kv, [0], 0).loaded


# --- requests that end early ------------------------------------------------------------------


def test_max_tokens_1_ends_at_prefill_without_a_handoff(tmp_path: Path) -> None:
    pair = make_pair(tmp_path)
    pair.add("one", prompt(20), greedy(1))
    with torch_threads(1):
        out = pair.prefill.step()
    assert not out.handoffs and out.retired == ["one"]
    ((token_out),) = out.tokens
    assert (token_out.request_id, token_out.index, token_out.finish_reason) == ("one", 0, "length")
    assert len(token_out.token_ids) == 1 and token_out.scheduled_at is not None
    assert spilled(pair) == [] and not pair.decode.has_work()
    pair.collect(out)
    pair.assert_clean()


def eos_first_prompt(tmp_path: Path) -> list[int]:
    """A prompt whose greedy first token is an EOS id (searched with the prefill engine)."""
    search = {"max_num_batched_tokens": 4096, "prefill_max_num_seqs": 512}
    pair = make_pair(tmp_path / "search", prefill=search)
    candidates = {f"p{i}": prompt(8, seed=1000 + i) for i in range(1024)}
    for rid, p in candidates.items():
        pair.add(rid, p, greedy(1))
    pair.run()
    eos = pair.prefill.eos_token_ids
    found = [rid for rid, tokens in pair.tokens.items() if tokens[0] in eos]
    assert found, "no prompt among 1024 starts with EOS"
    assert all(pair.finish[rid] == "stop" for rid in found)
    return candidates[found[0]]


def test_eos_as_first_token_ends_at_prefill_unless_ignored(tmp_path: Path) -> None:
    p = eos_first_prompt(tmp_path)
    pair = make_pair(tmp_path)
    pair.add("stops", p, greedy(10))
    pair.add("ignores", p, greedy(10, ignore_eos=True))
    pair.run()
    assert pair.finish == {"stops": "stop", "ignores": "length"}
    assert pair.tokens["stops"] == pair.tokens["ignores"][:1]
    assert len(pair.tokens["ignores"]) == 10
    assert pair.handoffs.keys() == {"ignores"}  # the stopped one never went to decode
    pair.assert_clean()


def test_sequences_end_at_the_cache_capacity(tmp_path: Path) -> None:
    """Decode holds 64 tokens: a 40-token prompt asking for 100 gets 24, ending with length,
    the same 24 it gets when it asks for exactly that."""
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    pair = make_pair(tmp_path / "small", decode_blocks=4)
    pair.add("r", prompt(40), params)
    pair.run()
    assert pair.finish == {"r": "length"} and len(pair.tokens["r"]) == 24
    pair.assert_clean()
    exact = make_pair(tmp_path / "exact")
    exact.add("r", prompt(40), SamplingParams(max_tokens=24, ignore_eos=True))
    assert exact.run()["r"] == pair.tokens["r"]
    # Prefill too: a prompt filling all but one slot ends at its first token.
    small = make_pair(tmp_path / "prefill", prefill_blocks=4)
    small.add("full", prompt(63), params)
    small.run()
    assert small.finish == {"full": "length"} and len(small.tokens["full"]) == 1
    assert not small.handoffs
    small.assert_clean()


def test_step_outputs_and_has_work(tmp_path: Path) -> None:
    pair = make_pair(tmp_path)
    assert not pair.prefill.has_work() and not pair.decode.has_work()
    empty = pair.prefill.step()
    assert not empty and empty.stats is None
    pair.add("a", prompt(20), greedy(3, ignore_eos=True))
    assert pair.prefill.has_work() and pair.prefill.num_waiting == 1
    with torch_threads(1):
        p_out, d_out = pair.step()
    assert p_out is not None and p_out.stats is not None
    assert (p_out.stats.num_seqs, p_out.stats.num_scheduled_tokens) == (1, 20)
    assert p_out.retired == ["a"] and len(p_out.handoffs) == 1 and p_out.transfers
    assert d_out is not None and d_out.transfers and d_out.transfers[0].transport == "shm"
    assert d_out.stats is not None and d_out.stats.num_generated_tokens == 1
    pair.run()
    assert len(pair.tokens["a"]) == 3
    pair.assert_clean()


def test_many_requests_under_pressure_match_a_relaxed_run(tmp_path: Path) -> None:
    """Mixed lengths and priorities through a tight decode cache (preemptions), small budgets
    (chunking, chunked recompute) and a small spill store (handoffs without KV): the same
    tokens as with room to spare, and nothing left behind."""
    rng = random.Random(5)
    requests = []
    for i in range(24):
        params = greedy(rng.choice([1, 3, 20, 60]), ignore_eos=bool(i % 2))
        n = rng.choice([1, 7, 16, 33, 70])
        requests.append((f"r{i}", prompt(n, seed=i), params, rng.choice([0, 0, 5])))

    def run(pair: EnginePair) -> EnginePair:
        for rid, p, params, priority in requests:
            pair.add(rid, p, params, priority=priority)
        pair.run()
        assert len(pair.finish) == 24 and not pair.errors
        pair.assert_clean()
        return pair

    tight = run(
        make_pair(
            tmp_path / "tight",
            decode_blocks=12,
            spill_max_bytes=20 * 4096,
            prefill={"max_num_batched_tokens": 64},
            decode={"max_num_batched_tokens": 32},
        )
    )
    assert tight.decode.scheduler.num_swaps > 0 and tight.swapped  # swapped out, taken back
    assert tight.decode.num_swaps_in > 0
    assert any(h.kv is None for h in tight.handoffs.values())
    relaxed = run(make_pair(tmp_path / "relaxed"))
    assert relaxed.decode.scheduler.num_preemptions == 0
    assert tight.tokens == relaxed.tokens and tight.finish == relaxed.finish


def test_a_descriptor_decode_cannot_read_is_recomputed_or_dropped(tmp_path: Path) -> None:
    """A foreign or malformed descriptor never breaks a verb: a load recomputes the KV, an abort
    or an expiry just drops the request."""
    reference = make_pair(tmp_path / "ref")
    reference.add("r", prompt(20), greedy(5, ignore_eos=True))
    expected = reference.run()["r"]

    pair = make_pair(tmp_path)
    foreign = KVDescriptor("carrier-pigeon", 1, 20, 4096, {"key": "x"})
    bad_key = KVDescriptor("shm", 1, 20, 4096, {"key": "../../etc/passwd"})
    d = pair.decode
    for rid, desc in (("load", foreign), ("abort", bad_key), ("expire", foreign)):
        req = NewRequest(
            rid,
            prompt(20),
            greedy(5, ignore_eos=True),
            output_token_ids=[expected[0]],
            kv=desc,
            deadline=time.time() + 100 if rid == "expire" else None,
        )
        assert d.add(req) is AddResult.ADDED
        pair.requests[rid] = req
        pair.tokens[rid] = [expected[0]]
    assert d.abort("abort")
    with torch_threads(1):
        out = d.step(now=time.time() + 101)  # "expire" is dropped before it is admitted
    assert "expire" in out.retired and not out.errors
    pair.aborted.add("abort")
    pair.collect(out)
    pair.run()
    assert pair.expired == {"expire"}
    assert pair.tokens["load"] == expected and pair.finish == {"load": "length"}
    assert pair.decode_log.chunks("load") == [20]  # recomputed inside decode
    pair.assert_clean()
