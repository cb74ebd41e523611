"""One engine "node" of the multi-node rig: the production engine, driven over stdin/stdout.

    python -m tests.multinode.node prefill|decode --model DIR --host ADDR --spill DIR

Builds the engine as the services do (``shared.engine.build``, ``BATON_KV_TRANSPORT=mooncake``
with ``kv_mooncake_host`` = this node's address on the link) and answers one JSON request per
line (``op``: add, step, release, state, quit) with one JSON line ``{"ok": ...}`` or
``{"error": ...}``. Only replies go to stdout (everything else printed goes to stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from shared.config import BatonConfig
from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.engine import EngineCore
from shared.engine.outputs import NewRequest
from shared.wire.messages import KVDescriptor, KVRelease
from shared.wire.sampling import SamplingParams


def _request(d: dict[str, Any]) -> NewRequest:
    kv = d.pop("kv", None)
    sampling = SamplingParams.from_dict(d.pop("sampling"))
    return NewRequest(**d, sampling=sampling, kv=KVDescriptor.from_map(kv) if kv else None)


def _step(engine: EngineCore) -> dict[str, Any]:
    out = engine.step()
    return {
        "tokens": [dataclasses.asdict(t) for t in out.tokens],
        "handoffs": [dataclasses.asdict(h) for h in out.handoffs],
        "errors": [dataclasses.asdict(e) for e in out.errors],
        "retired": out.retired,
        "releases": [dataclasses.asdict(r) for r in out.releases],
        "transfers": [dataclasses.asdict(t) for t in out.transfers],
        "has_work": engine.has_work(),
    }


def _state(engine: EngineCore) -> dict[str, Any]:
    bm, stats = engine.block_manager, engine.connector.stats()
    return {
        "free_blocks": bm.num_free_blocks,
        "num_blocks": bm.num_blocks,
        "requests": len(engine.requests),
        "has_work": engine.has_work(),
        "stats": dataclasses.asdict(stats),
        "segment": getattr(engine.connector, "segment", None),
        "eos": sorted(getattr(engine, "eos_token_ids", ())),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--spill", required=True)
    parser.add_argument("--blocks", type=int, default=128)
    args = parser.parse_args()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # logs and stray prints: stderr
    torch.set_num_threads(1)
    config = BatonConfig(
        model=args.model,
        num_kv_blocks=args.blocks,
        kv_transport="mooncake",
        kv_mooncake_host=args.host,
        kv_worker_id=f"{args.role}-{args.host}",
        spill_dir=args.spill,
    )
    build = build_prefill_engine if args.role == "prefill" else build_decode_engine
    engine: EngineCore = build(config, Path(args.model))
    replies.write(json.dumps({"ok": _state(engine)}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "add":
                ok: Any = engine.add(_request(cmd["request"])).name
            elif op == "step":
                ok = _step(engine)
            elif op == "release":
                engine.release(KVRelease(**cmd["notice"]))  # type: ignore[attr-defined]
                ok = None
            elif op == "state":
                ok = _state(engine)
            elif op == "quit":
                break
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": ok}
        except Exception as exc:
            reply = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        replies.write(json.dumps(reply) + "\n")
    engine.connector.close()
    replies.write(json.dumps({"ok": "bye"}) + "\n")


if __name__ == "__main__":
    main()
