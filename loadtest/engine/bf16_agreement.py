"""Greedy agreement of the bf16 engine with Hugging Face's bf16 ``generate`` on the tiny models.

    python3 -m loadtest.engine.bf16_agreement [--archs llama qwen2 qwen3] [--prompts 8] [--tokens
    32]

bf16 rounds differently in every kernel (HF's op-by-op torch ops, oneDNN's GEMM, the fused C
elementwise kernels), so greedy output is not pinned token for token as fp32's is: this reports
how far the two agree. Per arch: prompts whose whole continuation matches, and the share of
generated tokens before the first divergence; for the engine as built and with its bf16 kernels
turned off (torch's ops, F.linear) beside it. A measurement: it asserts nothing.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from shared.config import BatonConfig
from shared.runtime import BlockManager, ModelRunner, SamplingParams, Sequence
from shared.runtime.model import Projection
from tests.runtime.helpers import greedy, hf_greedy, tiny_model_dir


def engine_greedy(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    bm = BlockManager(runner.num_kv_blocks, runner.block_size)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    seqs = [Sequence(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    for s in seqs:
        bm.allocate(s)
    out: list[list[int]] = [[] for _ in seqs]
    firsts = runner.prefill(seqs, [s.num_tokens for s in seqs])
    for s, o, tok in zip(seqs, out, firsts, strict=True):
        assert tok is not None
        s.num_computed_tokens = s.num_tokens
        s.append_token(tok)
        o.append(tok)
    for _ in range(tokens - 1):
        for s in seqs:
            bm.append_slot(s)
        for s, o, tok in zip(seqs, out, runner.decode(seqs), strict=True):
            s.num_computed_tokens = s.num_tokens
            s.append_token(tok)
            o.append(tok)
    return out


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, float]:
    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))

    same = sum(g == w for g, w in zip(got, want, strict=True))
    share = sum(prefix(g, w) for g, w in zip(got, want, strict=True)) / sum(map(len, want))
    return same, share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["llama", "qwen2", "qwen3"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for arch in args.archs:
        path = tiny_model_dir(arch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        vocab = hf.config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.prompts)]  # fmt: skip
        want = [hf_greedy(hf, p, greedy(args.tokens, ignore_eos=True)) for p in prompts]
        runner = ModelRunner(BatonConfig(model=str(path), num_kv_blocks=256, dtype="bfloat16"))
        same, share = agreement(engine_greedy(runner, prompts, args.tokens), want)
        runner.model.use_bf16_kernels(None)
        for m in runner.model.modules():
            if isinstance(m, Projection):
                m.packed = None
        same_t, share_t = agreement(engine_greedy(runner, prompts, args.tokens), want)
        print(f"{arch:6s} bf16 vs HF bf16, {args.prompts} prompts x {args.tokens} tokens: "
              f"engine {same}/{args.prompts} identical, {share:.1%} tokens before divergence; "
              f"torch ops {same_t}/{args.prompts}, {share_t:.1%}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
