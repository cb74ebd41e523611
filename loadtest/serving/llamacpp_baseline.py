"""llama.cpp on the same GGUF file: the anchor for GGUF on CPU. Runs in a virtualenv of its own
that holds ``llama-cpp-python`` (it compiles llama.cpp from source on install):

    python3 -m venv VENV && VENV/bin/pip install llama-cpp-python
    VENV/bin/python loadtest/serving/llamacpp_baseline.py --gguf F.gguf --requests 16

Greedy decoding of ``--requests`` prompts of ``--prompt-len`` random token ids (seeded) for
``--output-len`` tokens each, EOS ignored, as Baton's bench does: once one sequence at a time
(one stream), once all of them in one batch (each sequence its own ``seq_id`` in one
``llama_batch``, prompts first, then one token per sequence per step). Prints output tokens per
second of each, as JSON. Imports nothing from Baton (another virtualenv runs it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import time
from typing import Any

import numpy as np

lc: Any = None  # llama_cpp, imported by main(): only its own virtualenv has it


def greedy_batch(
    ctx: object, vocab: int, prompts: list[list[int]], steps: int, n_batch: int
) -> list[list[int]]:
    """Every prompt as its own sequence, decoded together; the generated ids of each."""
    n = len(prompts)
    batch = lc.llama_batch_init(max(n_batch, n), 0, n)
    mem = lc.llama_get_memory(ctx)
    lc.llama_memory_clear(mem, True)
    out: list[list[int]] = [[] for _ in prompts]
    last_row: list[int] = [0] * n
    # Prefill in chunks of n_batch tokens; the last token of each prompt asks for logits.
    pending = [(s, i, t) for s, p in enumerate(prompts) for i, t in enumerate(p)]
    for start in range(0, len(pending), n_batch):
        chunk = pending[start : start + n_batch]
        batch.n_tokens = len(chunk)
        for j, (s, i, t) in enumerate(chunk):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, i, 1
            batch.seq_id[j][0] = s
            batch.logits[j] = i == len(prompts[s]) - 1
            if batch.logits[j]:
                last_row[s] = j
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for s, i, _ in chunk:
            if i == len(prompts[s]) - 1:
                out[s].append(_argmax(ctx, last_row[s], vocab))
    for step in range(1, steps):
        batch.n_tokens = n
        for s in range(n):
            batch.token[s], batch.pos[s], batch.n_seq_id[s] = (
                out[s][-1],
                len(prompts[s]) + step - 1,
                1,
            )
            batch.seq_id[s][0] = s
            batch.logits[s] = True
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for s in range(n):
            out[s].append(_argmax(ctx, s, vocab))
    lc.llama_batch_free(batch)
    return out


def _argmax(ctx: object, row: int, vocab: int) -> int:
    ptr = lc.llama_get_logits_ith(ctx, row)
    return int(
        np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,)).argmax()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    global lc
    import llama_cpp  # type: ignore[import-not-found]

    lc = llama_cpp
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(args.gguf.encode(), mparams)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    cparams = lc.llama_context_default_params()
    total = args.requests * (args.prompt_len + args.output_len)
    cparams.n_ctx = total + 256
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_seq_max = args.requests
    cparams.n_threads = cparams.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(model, cparams)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    greedy_batch(ctx, vocab, prompts[:1], 4, 512)  # warm-up
    t = time.perf_counter()
    for p in prompts:
        greedy_batch(ctx, vocab, [p], args.output_len, 512)
    one = time.perf_counter() - t
    t = time.perf_counter()
    greedy_batch(ctx, vocab, prompts, args.output_len, 512)
    batched = time.perf_counter() - t
    tokens = args.requests * args.output_len
    print(
        json.dumps(
            {
                "llama_cpp": lc.__version__,
                "gguf": args.gguf,
                "requests": args.requests,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "threads": args.threads,
                "one_stream_tok_s": tokens / one,
                "batched_tok_s": tokens / batched,
                "one_stream_s": one,
                "batched_s": batched,
            }
        )
    )


if __name__ == "__main__":
    main()
