"""Prompt → token ids: text, chat messages (the model's chat template) or ids as given."""

from __future__ import annotations

import json
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
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ProtocolError(
                    ErrorCode.INVALID_REQUEST,
                    f"prompt_token_ids contains {bad}, "
                    f"outside the vocabulary [0, {self.vocab_size})",
                )
        elif req.messages is not None:
            self._check_chars(sum(len(c) for _, c in req.messages))
            messages = [{"role": r, "content": c} for r, c in req.messages]
            try:
                rendered = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # jinja errors on roles the template rejects, etc.
                raise ProtocolError(
                    ErrorCode.INVALID_REQUEST, f"messages do not fit the chat template: {exc}"
                ) from None
            ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        else:
            assert req.prompt is not None
            self._check_chars(len(req.prompt))
            # Special tokens as HF adds them for plain text (e.g. Llama's BOS), matching
            # what `tokenizer(prompt)` + `generate` would see.
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
        if len(ids) > self.max_prompt_tokens:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {len(ids)} tokens, the limit is {self.max_prompt_tokens}",
            )
        if not ids:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "prompt encodes to no tokens")
        return ids

    def _check_chars(self, num_chars: int) -> None:
        # Refuse absurd text before spending CPU on tokenizing it.
        if num_chars > self._max_prompt_chars:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {num_chars} characters, far over the "
                f"{self.max_prompt_tokens}-token limit",
            )
