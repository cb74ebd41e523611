"""int8 KV cache against the exact one: bytes per token, greedy agreement, decode speed.

    python -m loadtest.kv_cache_dtype                 # every built-in arch + the bench model
    python -m loadtest.kv_cache_dtype --prompts 32 --max-tokens 128

For each model, the same greedy prompts run on a ModelRunner with ``kv_cache_dtype=auto`` (fp32,
the parity contract) and with ``int8`` (shared/runtime/kv_codec.py): one batched prefill, then
batched decode steps, which is the serving path's model work (the transports copy blocks bit
for bit). Printed per model: KV bytes per token, identical tokens (position by position), tokens
before each sequence's first difference, and decode tokens/s at the batch given (one thread).
End to end, run ``BATON_KV_CACHE_DTYPE=int8 python -m loadtest.bench --spawn``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from shared.config import REPO_ROOT, BatonConfig
from shared.models.tiny.builder import ARCHS, ensure_tiny_model
from shared.runtime.block_manager import BlockManager
from shared.runtime.model_runner import ModelRunner
from shared.runtime.sequence import Sequence
from shared.wire.sampling import SamplingParams

MODELS = [("tiny", arch) for arch in ARCHS] + [("bench", "llama")]


def generate(
    model_dir: Path,
    kv_cache_dtype: str,
    prompts: list[list[int]],
    max_tokens: int,
    forced: list[list[int]] | None = None,
) -> tuple[list[list[int]], float, int]:
    """Greedy picks, decode seconds, and KV bytes per token. With ``forced`` completions, each
    step is fed the forced token instead of its pick (the same history as the forced run), so
    the picks measure next-token agreement without one difference derailing the rest."""
    config = BatonConfig(model=str(model_dir), num_kv_blocks=0, kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(config)
    blocks = BlockManager(runner.num_kv_blocks, runner.block_size, False)
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        blocks.allocate(seq)
        seqs.append(seq)
    picks: list[list[int]] = [[] for _ in prompts]

    def advance(tokens: list[int]) -> None:
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            picks[i].append(token)
            seq.num_computed_tokens = seq.num_tokens
            seq.token_ids.append(forced[i][len(picks[i]) - 1] if forced else token)

    first = runner.prefill(seqs, [len(p) for p in prompts])
    advance([t for t in first if t is not None])
    t0 = time.perf_counter()
    for _ in range(max_tokens - 1):
        for seq in seqs:
            blocks.append_slot(seq)
        advance(runner.decode(seqs))
    return picks, time.perf_counter() - t0, runner.block_bytes // runner.block_size


def compare(preset: str, arch: str, num_prompts: int, max_tokens: int, seed: int) -> dict[str, Any]:
    name = "tiny" if (preset, arch) == ("tiny", "llama") else f"{preset}-{arch}"
    model_dir = ensure_tiny_model(REPO_ROOT / "models" / name, preset=preset, arch=arch)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 200))] for _ in range(num_prompts)
    ]
    exact, t_exact, bytes_exact = generate(model_dir, "auto", prompts, max_tokens)
    quant, t_quant, bytes_quant = generate(model_dir, "int8", prompts, max_tokens)
    forced, _, _ = generate(model_dir, "int8", prompts, max_tokens, forced=exact)
    same = sum(a == b for e, q in zip(exact, quant, strict=True) for a, b in zip(e, q, strict=True))
    next_same = sum(
        a == b for e, f in zip(exact, forced, strict=True) for a, b in zip(e, f, strict=True)
    )
    prefix = 0
    for e, q in zip(exact, quant, strict=True):
        prefix += next((i for i, (a, b) in enumerate(zip(e, q, strict=True)) if a != b), len(e))
    total = num_prompts * max_tokens
    steps = (max_tokens - 1) * num_prompts
    return {
        "model": name,
        "kv_bytes_per_token_fp32": bytes_exact,
        "kv_bytes_per_token_int8": bytes_quant,
        "int8_over_fp32": bytes_quant / bytes_exact,
        "int8_over_fp16": bytes_quant / (bytes_exact / 2),
        "identical_tokens": same / total,
        "tokens_before_first_difference": prefix / total,
        "next_token_agreement": next_same / total,
        "decode_tok_s_fp32": steps / t_exact,
        "decode_tok_s_int8": steps / t_quant,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="prompts per model (the decode batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    header = f"{'model':<14}{'B/tok fp32':>11}{'int8':>7}{'/fp32':>7}{'/fp16':>7}"
    header += f"{'same tok':>10}{'prefix':>8}{'next tok':>10}{'tok/s fp32':>12}{'int8':>8}"
    print(header)
    for preset, arch in MODELS:
        r = compare(preset, arch, args.prompts, args.max_tokens, args.seed)
        rows.append(r)
        print(
            f"{r['model']:<14}{r['kv_bytes_per_token_fp32']:>11}{r['kv_bytes_per_token_int8']:>7}"
            f"{r['int8_over_fp32']:>7.3f}{r['int8_over_fp16']:>7.3f}"
            f"{r['identical_tokens']:>10.1%}{r['tokens_before_first_difference']:>8.1%}"
            f"{r['next_token_agreement']:>10.1%}"
            f"{r['decode_tok_s_fp32']:>12.0f}{r['decode_tok_s_int8']:>8.0f}",
            flush=True,
        )
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
