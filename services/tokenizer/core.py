"""Prompt → token ids: text, chat messages (the model's chat template) or ids as given."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

from shared.limits import Limits
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.messages import RequestMsg


class PromptEncoder:
    def __init__(self, model_dir: Path, limits: Limits) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        model_config = json.loads((model_dir / "config.json").read_text())
        # Ids at or beyond the embedding table's size would index out of bounds in the model.
        self.vocab_size = int(model_config["vocab_size"])
        self.max_prompt_tokens = limits.max_prompt_tokens
        self._max_prompt_chars = self.max_prompt_tokens * 64  # no tokenizer yields < 1 char/64

    def encode(self, req: RequestMsg) -> list[int]:
        # A stop token id the model cannot produce is a client's mistake, not a no-op.
        self._check_vocab(req.sampling.stop_token_ids, "stop_token_ids")
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            self._check_vocab(ids, "prompt_token_ids")
        elif req.messages is not None:
            self._check_chars(sum(len(c) for _, c in req.messages))
            messages = [{"role": r, "content": c} for r, c in req.messages]
            ids = self.tokenize(self.render_chat(messages), add_special_tokens=False)
        else:
            assert req.prompt is not None
            self._check_chars(len(req.prompt))
            # Special tokens as HF adds them for plain text (e.g. Llama's BOS), matching
            # what `tokenizer(prompt)` + `generate` would see.
            ids = self.tokenize(req.prompt, add_special_tokens=True)
        if len(ids) > self.max_prompt_tokens:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens, the limit is {self.max_prompt_tokens}",
            )
        if not ids:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "prompt encodes to no tokens")
        return ids

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The model's chat template over ``messages``: the text a chat request is."""
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja errors on roles the template rejects, etc.
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST, f"messages do not fit the chat template: {exc}"
            ) from None
        return str(rendered)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids back to text, special tokens included (vLLM's /detokenize)."""
        self._check_vocab(ids, "tokens")
        return str(self.tokenizer.decode(list(ids)))

    def _check_vocab(self, ids: Sequence[int], field: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"{field} contains {bad}, outside the vocabulary [0, {self.vocab_size})",
            )

    def _check_chars(self, num_chars: int) -> None:
        # Refuse absurd text before spending CPU on tokenizing it.
        if num_chars > self._max_prompt_chars:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {num_chars} characters, far over the "
                f"{self.max_prompt_tokens}-token limit",
            )
