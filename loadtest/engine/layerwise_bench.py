"""Layer-wise against whole-request KV handoff over Mooncake (TCP): TTFT and the gap from the end
of prefill to decode's first step, for long prompts.

    python -m loadtest layerwise                        # 2k and 8k prompts, 3 rounds each
    python -m loadtest layerwise --lengths 8192 --rounds 5
    python -m loadtest layerwise --preset qwen2-0.5b --lengths 2048    # a real size

Prefill runs in this process and decode in a child process, each on its own core where the machine
has two, each with its own Mooncake transfer engine (``BATON_KV_TRANSPORT=mooncake``, TCP on
127.0.0.1: two nodes' worth of protocol on one machine). The production engines
(``shared.engine.build``) on the bench shape with long positions (``--preset bench-long``); handoffs
cross as their wire messages (``HandoffMsg``, ``KVReleaseMsg``) through a pipe instead of the
broker, whose hop (~1.5 ms) is the same either way. One request at a time, each generating 4 tokens:

- TTFT: arrival at prefill to its first token (the end of its last chunk's forward);
- gap: the end of that forward to the start of decode's first forward of the request (its KV
  in) — with the whole-request handoff, the descriptor's trip plus the whole pull; layer-wise,
  what was not pulled while prefill computed (the last layer of the last chunk) and reading
  the first token.

Printed per prompt length: the medians of both, with and without ``BATON_KV_LAYERWISE``, and the
bytes pulled. Figures to ``loadtest/results/layerwise.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from loadtest.models import preset_model
from shared.config import REPO_ROOT, BatonConfig
from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.outputs import NewRequest
from shared.runtime.logprobs import StepLogprobs
from shared.wire.messages import HandoffMsg, KVRelease, KVReleaseMsg
from shared.wire.sampling import SamplingParams

RESULTS = REPO_ROOT / "loadtest" / "results"
MAX_MESSAGE = 64 << 20
OUTPUT_LEN = 4


def _config(model: Path, spill: str, length: int, layerwise: bool) -> BatonConfig:
    return BatonConfig(
        model=str(model),
        kv_transport="mooncake",
        kv_mooncake_host="127.0.0.1",
        kv_layerwise=layerwise,
        kv_cache_mb=512,
        max_model_len=length + OUTPUT_LEN + 16,
        max_prompt_tokens=length,
        max_num_batched_tokens=2048,
        spill_dir=spill,
    )


# Prefill and decode on a core each where there are two: the CPUs this process may use when it
# starts (taken once: a process pinned for one measurement would hand its one core to the next
# decode worker it spawns).
CPUS = sorted(os.sched_getaffinity(0))


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)


def _cpu(role: int) -> int | None:
    return CPUS[role] if len(CPUS) > 1 else None


def decode_worker(model: str, spill: str, length: int, cpu: int | None, conn: Any) -> None:
    """Decode in its own process: handoffs in, (request id, first decode step start) and KV
    releases out."""
    _pin(cpu)
    engine = build_decode_engine(_config(Path(model), spill, length, True), Path(model))
    # When each request's first decode forward began (its KV in): the runner's decode call.
    began: dict[str, float] = {}
    runner_decode = engine.runner.decode

    def decode(seqs: list[Any], logprobs: StepLogprobs | None = None) -> list[int]:
        now = time.time()
        for seq in seqs:
            began.setdefault(seq.request_id, now)
        return runner_decode(seqs, logprobs)

    engine.runner.decode = decode  # type: ignore[method-assign]
    conn.send(("ready",))
    try:
        while True:
            while conn.poll(0 if engine.has_work() else 0.05):
                body = conn.recv_bytes()
                if not body:
                    return
                msg = HandoffMsg.decode(body, MAX_MESSAGE)
                engine.add(
                    NewRequest(
                        msg.request_id,
                        msg.prompt_token_ids,
                        msg.sampling,
                        msg.output_token_ids,
                        kv=msg.kv,
                    )  # fmt: skip
                )
            if not engine.has_work():
                continue
            out = engine.step()
            for t in out.tokens:
                if t.index == 1:
                    conn.send(("first_step", t.request_id, began.pop(t.request_id)))
            if out.releases:
                conn.send(("releases", KVReleaseMsg(releases=out.releases).encode()))
            for stat in out.transfers:
                conn.send(("pulled", stat.nbytes, stat.seconds))
    finally:
        engine.connector.close()


def measure(model: Path, length: int, layerwise: bool, rounds: int, seed: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="baton-lw-") as spill:
        parent, child = ctx.Pipe()
        args = (str(model), spill, length, _cpu(1), child)
        worker = ctx.Process(target=decode_worker, args=args)
        worker.start()
        _pin(_cpu(0))
        prefill = build_prefill_engine(_config(model, spill, length, layerwise), model)
        assert parent.recv() == ("ready",)
        rng = random.Random(seed)
        sampling = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
        ttft, gaps, pulled = [], [], []
        try:
            for r in range(rounds + 1):  # the first round warms both engines up
                rid = f"r{r}"
                prompt = [rng.randrange(3, 4000) for _ in range(length)]
                arrival = time.time()
                prefill.add(NewRequest(rid, prompt, sampling, arrival_time=arrival))
                prefill_end = first_step = None
                while first_step is None or prefill.has_work():
                    if prefill.has_work():
                        out = prefill.step()
                        now = time.time()
                        if any(t.request_id == rid and t.index == 0 for t in out.tokens):
                            prefill_end = now
                        for h in out.handoffs:
                            msg = HandoffMsg(h.request_id, prompt, list(h.output_token_ids),
                                             sampling, h.kv)  # fmt: skip
                            parent.send_bytes(msg.encode())
                    while parent.poll(0 if prefill.has_work() else 0.01):
                        kind, *rest = parent.recv()
                        if kind == "first_step":
                            first_step = rest[1]
                        elif kind == "releases":
                            for notice in KVReleaseMsg.decode(rest[0], MAX_MESSAGE).releases:
                                prefill.release(KVRelease(**asdict(notice)))
                        elif kind == "pulled" and r:
                            pulled.append(rest[0])
                assert prefill_end is not None and first_step is not None
                if r:
                    ttft.append(prefill_end - arrival)
                    gaps.append(first_step - prefill_end)
        finally:
            parent.send_bytes(b"")
            worker.join(timeout=30)
            prefill.connector.close()
    return {
        "prompt_len": length,
        "layerwise": layerwise,
        "rounds": rounds,
        "ttft_s_median": statistics.median(ttft),
        "gap_ms_median": statistics.median(gaps) * 1e3,
        "gap_ms_all": [g * 1e3 for g in gaps],
        "pulled_mib": statistics.mean(pulled) / 2**20 if pulled else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="bench-long", help="the model's shape (loadtest/models.py)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    model = preset_model(args.preset)
    print(f"{'prompt':>8}{'handoff':>12}{'TTFT s':>9}{'gap ms':>9}{'pulled MiB':>12}")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for layerwise in (False, True):
            r = measure(model, length, layerwise, args.rounds, args.seed)
            rows.append(r)
            mode = "layer-wise" if layerwise else "whole"
            print(
                f"{length:>8}{mode:>12}{r['ttft_s_median']:>9.2f}{r['gap_ms_median']:>9.1f}"
                f"{r['pulled_mib']:>12.1f}",
                flush=True,
            )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "layerwise.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
