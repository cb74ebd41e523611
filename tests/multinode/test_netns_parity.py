"""Greedy parity across two "nodes": prefill in one network namespace, decode in another, the KV
pulled over the veth link by ``BATON_KV_TRANSPORT=mooncake`` (TCP, no metadata server).

Both engines are the production ones (``shared.engine.build``), each in its own process and
namespace, driven by this test as the shells drive them over the broker (``tests/multinode/
rig.py`` says why not through the broker). The prompts are the production parity prompts
(``tests/test_parity.py``): every completion must equal transformers' greedy output, every KV
must have arrived through ``mooncake``, and both engines must end with every block free and
nothing pinned. Skipped, with the reason, where namespaces cannot be made or the transfer
engine is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.multinode.rig import Netns, Node, netns_pair, netns_unavailable
from tests.runtime.helpers import hf_greedy, tiny_model_dir, torch_threads
from tests.test_parity import build_cases

pytestmark = [pytest.mark.integration, pytest.mark.slow]

try:
    import mooncake.engine  # noqa: F401 - the wheel imports only with its native libraries
except ImportError as exc:
    pytest.skip(
        f"mooncake-transfer-engine is not usable here ({exc}); pip install "
        "mooncake-transfer-engine-non-cuda and apt-get install libibverbs1",
        allow_module_level=True,
    )
_why = netns_unavailable()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)


def _nodes(a: Netns, b: Netns, model: Path, tmp: Path) -> tuple[Node, Node]:
    args = ["--model", str(model)]
    prefill = Node(
        a, ["prefill", *args, "--host", a.addr, "--spill", str(tmp / "a")], tmp / "a.log"
    )
    try:
        decode = Node(
            b, ["decode", *args, "--host", b.addr, "--spill", str(tmp / "b")], tmp / "b.log"
        )
    except BaseException:
        prefill.close()
        raise
    return prefill, decode


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_parity_through_mooncake_between_namespaces(arch: str, tmp_path: Path) -> None:
    path = tiny_model_dir(arch)
    with torch_threads(1):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cases = build_cases(path, hf.config.vocab_size)
        expected = {c.name: hf_greedy(hf, c.prompt, c.sampling) for c in cases}
    tokens: dict[str, list[int]] = {c.name: [] for c in cases}
    finish: dict[str, str] = {}
    transfers: list[dict[str, Any]] = []
    with netns_pair() as (a, b):
        prefill, decode = _nodes(a, b, path, tmp_path)
        try:
            assert prefill.hello["segment"].startswith(a.addr + ":"), prefill.hello
            requests: dict[str, dict[str, Any]] = {}
            for i, case in enumerate(cases):
                requests[case.name] = {
                    "request_id": case.name,
                    "prompt_token_ids": case.prompt,
                    "sampling": case.sampling.to_dict(),
                    "arrival_time": float(i),
                }
                assert prefill.call("add", request=requests[case.name]) == "ADDED"

            def collect(out: dict[str, Any]) -> None:
                assert not out["errors"], out["errors"]
                for t in out["tokens"]:
                    got = tokens[t["request_id"]]
                    assert t["index"] == len(got), t  # in order, no gaps
                    got.extend(t["token_ids"])
                    if t["finish_reason"] is not None:
                        finish[t["request_id"]] = t["finish_reason"]

            p_work, d_work = True, False
            for _ in range(10_000):
                if not (p_work or d_work):
                    break
                if p_work:
                    out = prefill.call("step")
                    collect(out)
                    p_work = out["has_work"]
                    for h in out["handoffs"]:
                        assert h["kv"] is not None and h["kv"]["transport"] == "mooncake"
                        req = {
                            **requests[h["request_id"]],
                            "output_token_ids": h["output_token_ids"],
                            "kv": h["kv"],
                        }
                        assert decode.call("add", request=req) == "ADDED"
                        d_work = True
                if d_work:
                    out = decode.call("step")
                    collect(out)
                    transfers.extend(out["transfers"])
                    d_work = out["has_work"]
                    for notice in out["releases"]:
                        prefill.call("release", notice=notice)
            else:
                raise AssertionError("the engines did not finish")
            for notice in decode.call("step")["releases"]:  # as a service's idle step would
                prefill.call("release", notice=notice)
            p_state, d_state = prefill.call("state"), decode.call("state")
        finally:
            prefill.close()
            decode.close()
    for case in cases:
        assert tokens[case.name] == expected[case.name], case.name
        stopped = not case.ignore_eos and expected[case.name][-1] in d_state["eos"]
        assert finish[case.name] == ("stop" if stopped else "length"), case.name
    # Every prompt's KV crossed the link (none recomputed), and nothing leaked on either side.
    assert len(transfers) == len(cases) and {t["transport"] for t in transfers} == {"mooncake"}
    assert sum(t["nbytes"] for t in transfers) > 0
    assert d_state["stats"]["map_failures"] == d_state["stats"]["stale_loads"] == 0
    assert p_state["stats"]["pinned_blocks"] == 0 and p_state["stats"]["leases_expired"] == 0
    for state in (p_state, d_state):
        assert state["free_blocks"] == state["num_blocks"] and state["requests"] == 0
    for node in ("a", "b"):  # no KV went through a file: each node's spill folder is empty
        assert os.listdir(tmp_path / node) == [], node
