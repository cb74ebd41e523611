"""ModelRunner: owns the model, the paged KV cache and the sampler; one call = one forward.

Each call turns the scheduled sequences into flat tensors once (input_ids, positions,
slot_mapping, attention metadata, logits indices), runs the model under ``inference_mode`` and
samples. It reads the sequences but never mutates them: advancing ``num_computed_tokens``,
appending tokens and publishing prefix blocks is the caller's (scheduler's) job.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar, cast

import structlog
import torch

from kernels.cpu import mkl_dispatch
from kernels.cpu.argmax import load_argmax
from kernels.cpu.layer_ops import load_layer_ops
from kernels.cpu.rope import load_rope
from shared.config import BatonConfig
from shared.limits import Limits
from shared.models.catalog import resolve_model
from shared.runtime.attention import AttentionMetadata, select_backend
from shared.runtime.attention.common import LayerProgress
from shared.runtime.decode_program import DecodePrograms
from shared.runtime.fp_window import FpBatch, FpWindow, fp_batch
from shared.runtime.kv_codec import make_kv_codec
from shared.runtime.kv_tiers import HostKVTier, TierLayout, written_blocks
from shared.runtime.linear_layout import prepare_projections
from shared.runtime.loader import keeps_packed, load_model, resolve_dtype
from shared.runtime.logprobs import StepLogprobs, prompt_entries
from shared.runtime.model_config import ModelConfig
from shared.runtime.sampler import Sampler
from shared.runtime.sequence import Sequence

log = structlog.get_logger(__name__)

R = TypeVar("R")
KVCacheAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor | None]


class ModelRunner:
    def __init__(
        self,
        config: BatonConfig,
        model_dir: Path | None = None,
        allocate_kv_cache: KVCacheAllocator | None = None,
        kv_host_cache_bytes: int = 0,
        role: str | None = None,
        between_layers: Callable[[int], None] | None = None,
    ):
        """``allocate_kv_cache``: where the cache lives when a KV connector must own its memory
        (a pooled transport exports it to the receiver); it returns None to leave it to us.
        ``kv_host_cache_bytes``: a host tier of that size beside the device pool (kv_tiers.py).
        ``role`` (prefill, decode): which forms of the weights this engine keeps
        (linear_layout.py); None keeps every form. ``between_layers``: called with the number of
        layers done, between the layers of every forward, in the forward's thread (the shared
        CPU budget follows the other engine's work there: shared/engine/cpu_share.py)."""
        self.config = config
        self.between_layers = between_layers
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        model_dir = Path(model_dir) if model_dir else resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype, model_dir, self.device)
        # Everything that can refuse this model is checked before its weights are read.
        cfg = ModelConfig.from_dir(model_dir)
        packed = keeps_packed(model_dir, config.weight_format, self.device)
        self.kv_codec = make_kv_codec(config.kv_cache_dtype, packed)
        # int8's full-precision window (fp_window.py): slots of the pool the block manager hands
        # out with the window's blocks.
        self.fp_window = (
            FpWindow.plan(config.kv_fp_window, self.block_size, cfg.head_dim, self.dtype)
            if self.kv_codec.quantized
            else None
        )
        if self.fp_window is not None and kv_host_cache_bytes:
            raise ValueError(
                "BATON_KV_HOST_CACHE_MB stages block tables, not an int8 cache's full-precision "
                "window: set BATON_KV_FP_WINDOW=0 to use a host tier with int8"
            )
        kv_dtype = self.kv_codec.cache_dtype(self.dtype)
        if self.device.type != "cpu" and not self.kv_codec.quantized and kv_dtype != self.dtype:
            raise ValueError(
                f"BATON_KV_CACHE_DTYPE={config.kv_cache_dtype}: a cache in another float dtype "
                f"than the model's ({self.dtype}) runs on CPU only; use auto or int8"
            )
        row_width = self.kv_codec.row_width(cfg.head_dim)
        self.block_bytes = (
            cfg.num_layers * 2 * self.block_size * cfg.num_kv_heads * row_width * kv_dtype.itemsize
        )
        if config.num_kv_blocks > 0:
            num_on_device = config.num_kv_blocks
        else:
            num_on_device = (config.kv_cache_mb << 20) // self.block_bytes
        if num_on_device <= 0:
            raise ValueError(
                f"kv_cache_mb={config.kv_cache_mb} holds no block of {self.block_bytes} bytes"
            )
        # Staging is planned for the longest sequence the model and the configuration allow; the
        # cache's own bound comes with the plan.
        model_len = Limits.build(config, cfg.max_position_embeddings).max_model_len
        self.tiers = TierLayout.plan(
            num_on_device,
            kv_host_cache_bytes // self.block_bytes,
            -(-model_len // self.block_size),
        )
        # The block manager's blocks: the device pool and the host tier (staging is neither).
        self.num_kv_blocks = self.tiers.num_blocks
        # The lengths this engine serves, built once: what the engine core checks and stops at.
        self.limits = Limits.build(config, cfg.max_position_embeddings, self.max_seq_tokens)
        if self.tiers.num_host_blocks and self.limits.max_model_len < model_len:
            log.warning(
                "host KV tier: staging takes at most half the device's blocks, so sequences are "
                "cut to what it holds; raise kv_cache_mb to serve max_model_len",
                max_model_len=model_len,
                max_seq_tokens=self.max_seq_tokens,
            )
        self.model_config: ModelConfig
        self.model_config, self.model = load_model(
            model_dir, self.device, self.dtype, config.weight_format
        )
        kv_shape = (
            cfg.num_layers,
            2,
            num_on_device,
            self.block_size,
            cfg.num_kv_heads,
            row_width,
        )
        # The small C kernels (RoPE, greedy argmax; attention in select_backend): CPU, and not
        # turned off by BATON_CPU_ATTENTION=torch.
        c_kernels = self.device.type == "cpu" and config.cpu_attention == "auto"
        if self.device.type == "cpu":
            # A CPU decode step is bound by streaming weights and KV from memory.
            num_packed = prepare_projections(
                self.model,
                role,
                config.decode_linear,
                config.packed_prefill,
                self.dtype,
                config.packed_decode,
            )
            release_freed_memory()  # the buffers loading went through
            log.info("projections transposed", packed=num_packed,
                     weight_bytes=self.model.weight_bytes())  # fmt: skip
            if c_kernels and self.dtype == torch.float32:
                self.model.use_rope_kernel(load_rope())
                if role == "decode" or (role is None and self.model.quantized):
                    # The fused norms and SiLU * up part from torch's bits in the last ulp or
                    # two (the parity tests hold with them); packed weights' int8 activations
                    # part from exact fp32 anyway. The prefill engine's forward stays torch's,
                    # exact (packed weights: linear_layout.packed_form).
                    self.model.use_layer_kernels(load_layer_ops())
            elif c_kernels and self.dtype == torch.bfloat16:
                self.model.use_bf16_kernels(load_layer_ops())
        shared = allocate_kv_cache(kv_shape, kv_dtype, self.device) if allocate_kv_cache else None
        if shared is not None:
            self.kv_cache = shared  # zeroed by its owner
        elif self.device.type == "cpu":
            self.kv_cache = _zeros_on_huge_pages(kv_shape, kv_dtype)
        else:
            self.kv_cache = torch.zeros(kv_shape, dtype=kv_dtype, device=self.device)
        self.host_tier = (
            HostKVTier(self.kv_cache, self.tiers) if self.tiers.num_host_blocks else None
        )
        if role == "decode" and c_kernels and config.decode_program:
            self.model.decode_programs = DecodePrograms.create(self.model, self.kv_cache)
        self.attn_backend = select_backend(
            self.device,
            num_on_device,
            self.block_size,
            cfg.num_kv_heads,
            cfg.head_dim**-0.5,
            self.kv_codec,
            self.dtype,
            config.cpu_attention,
            cfg.head_dim,
            self.fp_window,
        )
        # Greedy rows through the C argmax (the same indices as torch's).
        argmax = load_argmax() if c_kernels else None
        self.sampler = Sampler(argmax, self.model_config.eos_token_ids)
        log.info(
            "model runner ready",
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            kv_cache_mb=round(self.kv_cache.numel() * kv_dtype.itemsize / 2**20, 1),
            kv_cache_dtype=self.kv_codec.name,
            kv_host_blocks=self.tiers.num_host_blocks,
            kv_staging_blocks=self.tiers.num_staging_blocks,
            attention=self.attn_backend.name,
            mkl_kernels="by features" if mkl_dispatch.preloaded() else "stock",
        )

    def fp_slots_config(self) -> dict[str, int]:
        """The block manager's full-precision window settings (BlockManager's keywords)."""
        w = self.fp_window
        return {"fp_window": w.tokens, "fp_slots_per_block": w.slots_per_block} if w else {}

    @property
    def max_seq_tokens(self) -> int:
        """The longest sequence the cache holds (with a host tier: what the staging area holds)."""
        return self.tiers.max_seq_blocks * self.block_size

    # --- forward passes -----------------------------------------------------------------------
    def prefill(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        on_layer: Callable[[int], None] | None = None,
        logprobs: StepLogprobs | None = None,
    ) -> list[int | None]:
        """Compute tokens ``[num_computed_tokens, num_computed_tokens + n)`` of each sequence.

        Returns a sampled token for each sequence whose chunk reaches its ``num_tokens`` (the
        prompt is complete), ``None`` for one that stopped mid-prompt (chunked prefill).
        ``on_layer(n)``: called once the first ``n`` layers' KV is in the cache (a layer-wise
        handoff publishes it; kv_transfer/layerwise.py). ``logprobs``: where the sequences that
        ask for them get their sampled token's logprobs and (``prompt_logprobs``) those of the
        prompt positions this chunk scores; None: nobody asks.
        """
        firsts = self.prefill_choices(seqs, num_new_tokens, on_layer, logprobs)
        return [None if tokens is None else tokens[0] for tokens in firsts]

    def prefill_choices(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        on_layer: Callable[[int], None] | None = None,
        logprobs: StepLogprobs | None = None,
    ) -> list[list[int] | None]:
        """:meth:`prefill`, with the first token of every choice of a prompt that asks for
        ``sampling.n`` > 1: n draws from the prompt's one row of logits, choice ``i`` with its
        index mixed into the seed (greedy ones all take the argmax). ``logprobs`` keys each
        draw's entry by (request id, choice)."""
        if len(seqs) != len(num_new_tokens) or not seqs:
            raise ValueError("prefill needs one positive token count per sequence")
        spans = [
            (s.num_computed_tokens, s.num_computed_tokens + n)
            for s, n in zip(seqs, num_new_tokens, strict=True)
        ]
        return self._through_tiers(
            seqs,
            spans,
            lambda rows, tables: self._prefill(
                [seqs[r] for r in rows],
                [num_new_tokens[r] for r in rows],
                tables,
                on_layer,
                logprobs,
            ),
        )

    def decode(self, seqs: list[Sequence], logprobs: StepLogprobs | None = None) -> list[int]:
        """One token per sequence from its last token (position ``num_tokens - 1``, whose slot
        the caller has appended). ``logprobs``: as in :meth:`prefill`."""
        if not seqs:
            return []
        spans = [(s.num_tokens - 1, s.num_tokens) for s in seqs]
        tokens = self._through_tiers(
            seqs,
            spans,
            lambda rows, tables: self._decode([seqs[r] for r in rows], tables, logprobs),
        )
        return cast(list[int], tokens)  # every row of a decode forward samples

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, ``(src, dst)`` block ids of either tier: a forked sequence's own
        copy of the block it writes next (copy-on-write, BlockManager.fork). Between forwards."""
        for src, dst in pairs:
            self._block(dst).copy_(self._block(src))

    def _block(self, block_id: int) -> torch.Tensor:
        """Every layer's K and V of one block, where that block lives."""
        tier = self.host_tier
        if tier is not None and tier.is_host(block_id):
            return tier.host_cache[block_id - tier.layout.num_device_blocks]
        return self.kv_cache[:, :, block_id]

    def _through_tiers(
        self,
        seqs: list[Sequence],
        spans: list[tuple[int, int]],
        forward: Callable[[list[int], list[list[int]]], Iterable[R | None]],
    ) -> list[R | None]:
        """Run ``forward(rows, block_tables)``: once over the sequences' own tables, or, when
        some hold host blocks, once per group of rows whose host blocks fit the staging area,
        through staged tables, writing the blocks each group extended (``spans``) back."""
        tables = [s.block_table for s in seqs]
        tier = self.host_tier
        if tier is None or not any(tier.holds_host(t) for t in tables):
            return list(forward(list(range(len(seqs))), tables))
        out: list[R | None] = [None] * len(seqs)
        for rows in tier.split(tables):
            staged = tier.stage([tables[r] for r in rows])
            results = forward(rows, staged.tables)
            written: set[int] = set()
            for r in rows:
                written |= written_blocks(tables[r], *spans[r], self.block_size)
            tier.write_back(staged, written)
            for r, token in zip(rows, results, strict=True):
                out[r] = token
        return out

    def _prefill(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        tables: list[list[int]],
        on_layer: Callable[[int], None] | None = None,
        logprobs: StepLogprobs | None = None,
    ) -> list[list[int] | None]:
        bs = self.block_size
        # (sequence, its first row, first prompt position scored, positions): the prompt
        # tokens after each chunk position, which that position's logits score.
        scored: list[tuple[Sequence, int, int, int]] = []
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        sampled_rows: list[int] = []  # one per draw: a prompt's row once per choice
        choices: list[int] = []
        for i, (seq, n, table) in enumerate(zip(seqs, num_new_tokens, tables, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if n <= 0 or end > seq.num_tokens:
                raise ValueError(f"{seq.request_id!r}: cannot compute tokens {start}..{end}")
            if len(table) * bs < end:
                raise ValueError(f"{seq.request_id!r}: blocks for {end} tokens not allocated")
            if logprobs is not None and seq.sampling.prompt_logprobs is not None:
                last = min(end + 1, seq.num_prompt_tokens)
                if last > start + 1:
                    scored.append((seq, len(input_ids), start + 1, last - start - 1))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            _extend_slots(slot_mapping, table, start, end, bs)
            context_lens.append(end)
            if end == seq.num_tokens:
                # A prompt's first tokens: one per choice. A sequence with output is one choice.
                fork = seq.sampling.n if seq.num_output_tokens == 0 else 1
                draws = range(fork) if fork > 1 else (seq.choice_index,)
                logits_indices.extend([len(input_ids) - 1] * len(draws))
                sampled_rows.extend([i] * len(draws))
                choices.extend(draws)
        spans = [(e - n, e) for n, e in zip(num_new_tokens, context_lens, strict=True)]
        fp = self._fp_batch(seqs, spans)
        meta: AttentionMetadata = self.attn_backend.prefill_metadata(
            slot_mapping, tables, num_new_tokens, context_lens, fp
        )
        if on_layer is not None:
            meta = LayerProgress(meta, on_layer)
        sampled = self._run(
            input_ids,
            positions,
            meta,
            logits_indices,
            [seqs[i] for i in sampled_rows],
            choices,
            logprobs,
            scored,
        )
        out: list[list[int] | None] = [None] * len(seqs)
        for row, token in zip(sampled_rows, sampled, strict=True):
            tokens = out[row]
            if tokens is None:
                out[row] = [token]
            else:
                tokens.append(token)
        return out

    def _decode(
        self, seqs: list[Sequence], tables: list[list[int]], logprobs: StepLogprobs | None
    ) -> list[int]:
        bs = self.block_size
        positions = [seq.num_tokens - 1 for seq in seqs]
        slot_mapping = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        context_lens = [p + 1 for p in positions]
        fp = self._fp_batch(seqs, [(p, p + 1) for p in positions])
        meta = self.attn_backend.decode_metadata(slot_mapping, tables, context_lens, fp)
        input_ids = [seq.token_ids[-1] for seq in seqs]
        choices = [seq.choice_index for seq in seqs]
        return self._run(
            input_ids, positions, meta, list(range(len(seqs))), seqs, choices, logprobs
        )

    def _fp_batch(self, seqs: list[Sequence], spans: list[tuple[int, int]]) -> FpBatch | None:
        """The forward's full-precision windows (int8 with BATON_KV_FP_WINDOW), or None."""
        if self.fp_window is None:
            return None
        firsts = [s.fp_first_block for s in seqs]
        return fp_batch(self.fp_window, spans, firsts, [s.fp_blocks for s in seqs], self.device)

    @torch.inference_mode()
    def _run(
        self,
        input_ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        logits_indices: list[int],
        sample_seqs: list[Sequence],
        choices: list[int],
        logprobs: StepLogprobs | None = None,
        scored: list[tuple[Sequence, int, int, int]] | None = None,
    ) -> list[int]:
        """The forward, then one draw per entry of ``logits_indices`` (a row of the output,
        repeated for a prompt's several choices) for ``sample_seqs``' choice ``choices``."""
        dev = self.device
        if self.between_layers is not None:
            meta = LayerProgress(meta, self.between_layers)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_cache,
            meta,
        )
        if logprobs is not None and scored:
            self._score_prompts(hidden, scored, logprobs)
        if not logits_indices:
            return []
        if logits_indices != list(range(hidden.shape[0])):  # a row once per draw
            hidden = hidden[torch.tensor(logits_indices, dtype=torch.int64, device=dev)]
        logits = self.model.compute_logits(hidden)
        sampling = [s.sampling for s in sample_seqs]
        tokens = self.sampler(
            logits,
            sampling,
            [s.num_tokens for s in sample_seqs],
            sample_seqs,
            choices if any(choices) else None,
        )
        if logprobs is not None:
            for row, entry in self.sampler.logprobs(logits, tokens, sampling).items():
                logprobs.sampled[(sample_seqs[row].request_id, choices[row])] = entry
        return tokens

    def _score_prompts(
        self,
        hidden: torch.Tensor,
        scored: list[tuple[Sequence, int, int, int]],
        logprobs: StepLogprobs,
    ) -> None:
        """The prompt logprobs of the positions this forward computed (vLLM's
        ``prompt_logprobs``): only for the sequences that asked, from their rows' logits."""
        vocab = self.model_config.vocab_size
        for seq, row, first, count in scored:
            entries = prompt_entries(
                self.model.compute_logits,
                hidden[row : row + count],
                seq.token_ids[first : first + count],
                seq.sampling.prompt_logprobs or 0,
                vocab,
            )
            positions = logprobs.prompt.setdefault(seq.request_id, {})
            positions.update(zip(range(first, first + count), entries, strict=True))


def release_freed_memory() -> None:
    """Give the memory freed while loading back to the OS: the services raise glibc's mmap
    threshold (services/__main__.py), so loading's large temporaries came from the heap, and a
    freed heap chunk below the top stays resident until ``malloc_trim`` returns its pages."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on anonymous memory advised for transparent huge pages.

    A decode step reads every running sequence's KV (tens of MB, scattered by block): with
    4 KiB pages the TLB misses cost about a third of that read. The pages are touched here, as
    torch.zeros would, so the memory is committed at start-up rather than faulted in while
    serving. The tensor keeps the mapping alive.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only; elsewhere plain pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape).zero_()


def _extend_slots(out: list[int], block_table: list[int], start: int, end: int, bs: int) -> None:
    """Append the cache slots of positions ``start..end-1``: one range per block touched."""
    for b in range(start // bs, (end - 1) // bs + 1):
        base = block_table[b] * bs - b * bs
        out.extend(range(base + max(start, b * bs), base + min(end, (b + 1) * bs)))
