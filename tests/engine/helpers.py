"""Shared by the engine tests and tests/test_parity.py: tiny models, a miniature scheduler that
drives the engine the way the services do, and the Hugging Face reference."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from shared.config import REPO_ROOT, BatonConfig
from shared.engine import BlockManager, ModelRunner, SamplingParams, Sequence, SequenceStatus
from shared.tiny_model import ensure_tiny_model

MODELS_DIR = REPO_ROOT / "models"


def tiny_model_dir(arch: str, preset: str = "tiny") -> Path:
    """The built-in model for (preset, arch), built once into the git-ignored models/ folder
    (tiny llama is the default model dir itself)."""
    name = "tiny" if (preset, arch) == ("tiny", "llama") else f"{preset}-{arch}"
    return ensure_tiny_model(MODELS_DIR / name, preset=preset, arch=arch)


def make_runner(model_dir: Path, num_kv_blocks: int = 256, **overrides: object) -> ModelRunner:
    config = BatonConfig(model=str(model_dir), num_kv_blocks=num_kv_blocks, **overrides)  # type: ignore[arg-type]
    return ModelRunner(config)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """The tiny models gain nothing from threads, and on a busy 2-core box OpenMP spinning makes
    HF generate ~10x slower; restored afterwards so other tests see the defaults."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class MiniEngine:
    """The services' loop in miniature, over one ModelRunner and one BlockManager.

    Each ``prefill_step`` fills a token budget: unfinished chunked prompts first, then waiting
    sequences in order (short prompts batch together, a long one is chunked). ``decode_step``
    advances every running sequence by one token. ``run`` alternates them, so sequences join a
    running decode batch mid-way (continuous batching).
    """

    def __init__(self, runner: ModelRunner, token_budget: int = 128, prefix_caching: bool = True):
        self.runner = runner
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, prefix_caching)
        self.token_budget = token_budget
        self.eos_token_ids = set(runner.model_config.eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished: dict[str, Sequence] = {}
        self.prefill_batches: list[list[tuple[str, int]]] = []  # (request_id, chunk) per step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def prefill_step(self) -> None:
        budget = self.token_budget
        batch: list[Sequence] = []
        counts: list[int] = []
        for seq in list(self.prefilling):
            if budget == 0:
                break
            n = min(budget, seq.num_tokens - seq.num_computed_tokens)
            batch.append(seq)
            counts.append(n)
            budget -= n
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.prefilling.append(seq)
            n = min(budget, seq.num_tokens - seq.num_computed_tokens)
            batch.append(seq)
            counts.append(n)
            budget -= n
        if not batch:
            return
        self.prefill_batches.append([(s.request_id, n) for s, n in zip(batch, counts, strict=True)])
        tokens = self.runner.prefill(batch, counts)
        for seq, n, token in zip(batch, counts, tokens, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
            if token is not None:
                self.prefilling.remove(seq)
                self._append(seq, token)

    def decode_step(self) -> None:
        if not self.running:
            return
        batch = list(self.running)
        for seq in batch:
            self.block_manager.append_slot(seq)
        tokens = self.runner.decode(batch)
        for seq, token in zip(batch, tokens, strict=True):
            seq.num_computed_tokens = seq.num_tokens
            self.block_manager.cache_computed_blocks(seq)
            self.running.remove(seq)
            self._append(seq, token)

    def preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV; it is recomputed (prompt + output so far) on re-admit."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def run(self, max_steps: int = 10_000) -> dict[str, Sequence]:
        for _ in range(max_steps):
            if not (self.waiting or self.prefilling or self.running):
                return self.finished
            if self.waiting or self.prefilling:
                self.prefill_step()
            self.decode_step()
        raise RuntimeError("MiniEngine did not finish")

    def _append(self, seq: Sequence, token: int) -> None:
        seq.append_token(token)
        stop = token in self.eos_token_ids and not seq.sampling.ignore_eos
        if stop or seq.num_output_tokens >= seq.sampling.max_tokens:
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free(seq)
            self.finished[seq.request_id] = seq
        else:
            self.running.append(seq)


def greedy(max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def hf_greedy(model: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' greedy continuation: stops at the model's EOS ids, or with ``ignore_eos``
    generates past them (``eos_token_id=None``: nothing is masked, exactly Baton's ignore_eos).

    Passed as keyword arguments: a GenerationConfig object holding ``eos_token_id=None`` is
    merged with the model's defaults by transformers 5, which brings the EOS ids back.
    """
    ids = torch.tensor([prompt])
    overrides: dict[str, Any] = {"eos_token_id": None} if params.ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=params.max_tokens,
            **overrides,
        )
    return out[0, len(prompt) :].tolist()
