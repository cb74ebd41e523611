"""int8 KV caches against the exact one: bytes per token, greedy agreement, decode speed.

    python -m loadtest kv-dtype                       # every built-in arch + the bench model
    python -m loadtest kv-dtype --fp-window 128 --long-tokens 500 --models bench
    python -m loadtest kv-dtype --models qwen2-0.5b-qwen2 --prompts 4    # a real size

For each model, the same greedy prompts run on a ModelRunner with ``kv_cache_dtype=auto`` (fp32,
the parity contract), with ``int8`` whole (``BATON_KV_FP_WINDOW=0``) and with int8 beside a
full-precision window of the last ``--fp-window`` tokens (shared/runtime/fp_window.py): one
batched prefill, then batched decode steps — the serving path's model work (the transports copy
blocks bit for bit). Two workloads:

- the *parity prompts*: the shapes of tests/test_parity.py's cases (1 to 300 tokens of random
  ids, 8 to 64 generated), the prompts HF parity is checked on;
- *long generations*: ``--prompts`` prompts of 8-200 tokens generating ``--long-tokens`` (500):
  the window slides, the old tokens are int8.

Printed per model and cache: KV bytes per token of a 4,096-token sequence (the blocks and
full-precision slots the block manager holds for it), next-token agreement with fp32 (each step
fed fp32's token, so one difference does not derail the rest: the per-step effect of rounding)
on both workloads, identical tokens of the free-running long generations, and decode tokens/s
of the long workload's batch (one thread). End to end: ``BATON_KV_CACHE_DTYPE=int8 python -m
loadtest bench --spawn``; long prompts: ``python -m loadtest longctx``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loadtest.models import arch_of, preset_model
from shared.config import BatonConfig
from shared.models.tiny.builder import ARCHS, model_dir_name
from shared.runtime.block_manager import BlockManager
from shared.runtime.model_runner import ModelRunner
from shared.runtime.sequence import Sequence
from shared.wire.sampling import SamplingParams

MODELS = [("tiny", arch) for arch in ARCHS] + [("bench", "llama")]
REAL_SIZE = [("qwen2-0.5b", arch_of("qwen2-0.5b"))]  # only when --models names it
# (prompt tokens, generated tokens) of tests/test_parity.py's cases.
PARITY_SHAPES = [
    (1, 24), (7, 16), (16, 16), (16, 8), (40, 16), (70, 24), (64, 64), (129, 12), (300, 20),
    (40, 40), (40, 40),
]  # fmt: skip
CONTEXT = 4096  # bytes per token are reported at this sequence length


@dataclass(frozen=True)
class Cache:
    name: str
    kv_cache_dtype: str
    fp_window: int = 0


@dataclass
class Run:
    picks: list[list[int]]
    decode_s: float
    steps: int


def make_runner(model_dir: Path, cache: Cache) -> tuple[ModelRunner, BlockManager]:
    config = BatonConfig(
        model=str(model_dir),
        num_kv_blocks=0,
        kv_cache_mb=512,
        max_model_len=CONTEXT + 16,
        kv_cache_dtype=cache.kv_cache_dtype,
        kv_fp_window=cache.fp_window,
    )
    runner = ModelRunner(config)
    blocks = BlockManager(
        runner.num_kv_blocks, runner.block_size, False, **runner.fp_slots_config()
    )
    return runner, blocks


def bytes_per_token(model_dir: Path, cache: Cache) -> float:
    """The pool bytes a ``CONTEXT``-token sequence holds, per token."""
    runner, blocks = make_runner(model_dir, cache)
    seq = Sequence("r", [1] * CONTEXT, SamplingParams())
    blocks.allocate(seq)
    return blocks.num_used_blocks * runner.block_bytes / CONTEXT


def generate(
    model_dir: Path,
    cache: Cache,
    prompts: list[list[int]],
    max_tokens: list[int],
    forced: list[list[int]] | None = None,
) -> Run:
    """Greedy picks and decode seconds. With ``forced`` completions, each step is fed the forced
    token instead of its pick (the same history as the forced run), so the picks measure
    next-token agreement."""
    runner, blocks = make_runner(model_dir, cache)
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
        blocks.allocate(seq)
        seqs.append(seq)
    picks: list[list[int]] = [[] for _ in prompts]

    def advance(batch: list[Sequence], tokens: list[int]) -> None:
        for seq, token in zip(batch, tokens, strict=True):
            i = int(seq.request_id[1:])
            picks[i].append(token)
            seq.num_computed_tokens = seq.num_tokens
            seq.token_ids.append(forced[i][len(picks[i]) - 1] if forced else token)
            blocks.cache_computed_blocks(seq)  # ages the full-precision window

    first = runner.prefill(seqs, [len(p) for p in prompts])
    advance(seqs, [t for t in first if t is not None])
    t0, steps = time.perf_counter(), 0
    while running := [s for s in seqs if len(picks[int(s.request_id[1:])]) < s.sampling.max_tokens]:
        for seq in running:
            blocks.append_slot(seq)
        advance(running, runner.decode(running))
        steps += len(running)
    return Run(picks, time.perf_counter() - t0, steps)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def compare(
    preset: str, arch: str, caches: list[Cache], num_prompts: int, long_tokens: int, seed: int
) -> list[dict[str, Any]]:
    model_dir = preset_model(preset, arch)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    parity = [[rng.randrange(3, vocab) for _ in range(n)] for n, _ in PARITY_SHAPES]
    parity_tokens = [m for _, m in PARITY_SHAPES]
    long = [
        [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 200))] for _ in range(num_prompts)
    ]
    long_tokens_all = [long_tokens] * num_prompts
    exact_parity = generate(model_dir, caches[0], parity, parity_tokens)
    exact_long = generate(model_dir, caches[0], long, long_tokens_all)
    rows = []
    for cache in caches:
        free = generate(model_dir, cache, long, long_tokens_all)
        forced_parity = generate(model_dir, cache, parity, parity_tokens, exact_parity.picks)
        forced_long = generate(model_dir, cache, long, long_tokens_all, exact_long.picks)
        rows.append(
            {
                "model": model_dir.name,
                "cache": cache.name,
                "kv_bytes_per_token_4k": bytes_per_token(model_dir, cache),
                "next_token_agreement_parity": agreement(exact_parity.picks, forced_parity.picks),
                "next_token_agreement_long": agreement(exact_long.picks, forced_long.picks),
                "identical_tokens_long": agreement(exact_long.picks, free.picks),
                "decode_tok_s": free.steps / free.decode_s,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="long-generation prompts (the batch)")
    p.add_argument("--long-tokens", type=int, default=500, help="tokens each long prompt generates")
    p.add_argument(
        "--fp-window", type=int, default=128, help="BATON_KV_FP_WINDOW of the window run"
    )
    p.add_argument(
        "--models", default=None,
        help="comma-separated models/ names, e.g. tiny,bench,qwen2-0.5b-qwen2 (default: all but "
        "the real size)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    caches = [
        Cache("fp32", "auto"),
        Cache("int8", "int8", 0),
        Cache(f"int8+fp{args.fp_window}", "int8", args.fp_window),
    ]
    wanted = set(args.models.split(",")) if args.models else None
    rows = []
    header = f"{'model':<14}{'cache':<13}{'B/tok@4k':>9}{'next(parity)':>14}{'next(long)':>12}"
    header += f"{'same(long)':>12}{'tok/s':>9}"
    print(header)
    for preset, arch in MODELS if wanted is None else MODELS + REAL_SIZE:
        if wanted is not None and model_dir_name(preset, arch) not in wanted:
            continue
        for r in compare(preset, arch, caches, args.prompts, args.long_tokens, args.seed):
            rows.append(r)
            print(
                f"{r['model']:<14}{r['cache']:<13}{r['kv_bytes_per_token_4k']:>9.0f}"
                f"{r['next_token_agreement_parity']:>14.2%}{r['next_token_agreement_long']:>12.2%}"
                f"{r['identical_tokens_long']:>12.1%}{r['decode_tok_s']:>9.0f}",
                flush=True,
            )
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
