"""What logprobs cost the engine: a prefill wave with prompt logprobs, a decode step with top-20
logprobs, each as a ratio to the same forward without them (the engine's runner, no broker).

    python -m loadtest logprobs-cost [--preset bench | --model DIR] [--batch 8] [--prompt 256]
        [--prompt-top 1] [--top 20] [--context 64] [--repeats 5] [--threads 1]

Prefill: ``batch`` prompts of ``prompt`` tokens in one forward, with ``prompt_logprobs`` =
``prompt-top`` (lm-evaluation-harness's log-likelihood asks for 1) against none; every prompt
position is scored, so the cost is one ``[prompt, vocab]`` head projection and ``log_softmax``
per prompt on top of the forward, which samples one position. Decode: the same step of the
whole batch (replayed: same token, same KV slots) with ``logprobs`` = ``top`` against none.
Runs alternate, the median of ``repeats`` each; both scale with the vocabulary (the presets'
is 4k; a real model's 32k-150k costs proportionally more). A benchmark: it prints figures and
asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kernels.cpu import cpu_isa, mkl_dispatch
from shared.config import BatonConfig

if __name__ == "__main__":  # the engine's MKL kernels, as the services choose them
    cpu_isa.apply(BatonConfig.from_env().cpu_isa)
    mkl_dispatch.ensure(BatonConfig.from_env().mkl_dispatch)

import torch  # noqa: E402

from loadtest.models import preset_model  # noqa: E402
from shared.runtime import BlockManager, ModelRunner, SamplingParams, Sequence  # noqa: E402
from shared.runtime.logprobs import StepLogprobs  # noqa: E402


def alternate(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs taking turns (after one warm-up each)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.engine.logprobs_cost", description=__doc__
    )
    ap.add_argument("--preset", default="bench", help="a built-in shape (loadtest/models.py)")
    ap.add_argument("--model", type=Path, help="a model directory instead of the preset")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--prompt-top", type=int, default=1, help="prompt_logprobs alternatives")
    ap.add_argument("--top", type=int, default=20, help="logprobs alternatives when decoding")
    ap.add_argument("--context", type=int, default=64, help="tokens per sequence when decoding")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or preset_model(args.preset)
    # Two batches of prompts, two of decoding sequences, each in blocks of its own.
    blocks = 2 * args.batch * (-(-args.prompt // 16) - (-args.context // 16)) + 8
    runner = ModelRunner(BatonConfig(model=str(model_dir), num_kv_blocks=blocks))
    bm = BlockManager(runner.num_kv_blocks, runner.block_size, enable_prefix_caching=False)
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def sequences(n: int, sampling: SamplingParams) -> list[Sequence]:
        seqs = []
        for i in range(args.batch):
            seq = Sequence(f"r{i}", torch.randint(3, vocab, (n,), generator=g).tolist(), sampling)
            bm.allocate(seq)
            seqs.append(seq)
        return seqs

    def prefill(sampling: SamplingParams, scored: bool) -> Callable[[], object]:
        seqs = sequences(args.prompt, sampling)
        logprobs = StepLogprobs() if scored else None
        return lambda: runner.prefill(seqs, [args.prompt] * args.batch, None, logprobs)

    asked = SamplingParams(max_tokens=1, prompt_logprobs=args.prompt_top)
    prefill_s = alternate(
        {"plain": prefill(SamplingParams(max_tokens=1), False), "scored": prefill(asked, True)},
        args.repeats,
    )

    def decode(sampling: SamplingParams, scored: bool) -> Callable[[], object]:
        seqs = sequences(args.context, sampling)
        runner.prefill(seqs, [args.context - 1] * args.batch)  # all but the step's token
        logprobs = StepLogprobs() if scored else None

        def step() -> object:
            for s in seqs:
                s.num_computed_tokens = s.num_tokens - 1  # the same step again: same KV slots
            return runner.decode(seqs, logprobs)

        return step

    top = SamplingParams(max_tokens=8, logprobs=args.top)
    decode_s = alternate(
        {"plain": decode(SamplingParams(max_tokens=8), False), "scored": decode(top, True)},
        args.repeats * 5,
    )

    print(f"model {model_dir.name}: vocab {vocab}, batch {args.batch}, {args.threads} thread(s)")
    print(
        f"prefill {args.batch} x {args.prompt} tokens: {prefill_s['plain'] * 1e3:.1f} ms, with "
        f"prompt_logprobs={args.prompt_top} {prefill_s['scored'] * 1e3:.1f} ms: "
        f"x{prefill_s['scored'] / prefill_s['plain']:.2f}"
    )
    print(
        f"decode step of {args.batch} at {args.context} tokens: {decode_s['plain'] * 1e3:.2f} ms, "
        f"with logprobs={args.top} {decode_s['scored'] * 1e3:.2f} ms: "
        f"x{decode_s['scored'] / decode_s['plain']:.2f}"
    )


if __name__ == "__main__":
    main()
