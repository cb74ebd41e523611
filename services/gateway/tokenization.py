"""``POST /tokenize`` and ``POST /detokenize``, shaped as vLLM's.

The gateway holds no tokenizer for serving (the tokenizer service tokenizes every request), so
these routes load one of their own, on first use: the tokenizer service's own
:class:`~services.tokenizer.core.PromptEncoder` over the same model directory, so a prompt
tokenizes here exactly as it will in the pipeline (special tokens, chat template and all). A
gateway nobody asks to tokenize never loads transformers. Tokenizing runs on one worker thread:
the event loop keeps streaming other requests meanwhile, and the tokenizer (whose fast Rust
object refuses concurrent use) sees one call at a time.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.gateway.api_requests import check_model, messages_of, text_of, token_ids_of
from services.gateway.errors import flag, invalid
from shared.config import BatonConfig
from shared.limits import Limits
from shared.wire.errors import ProtocolError

if TYPE_CHECKING:
    from services.tokenizer.core import PromptEncoder

# Request fields vLLM's tokenize routes take that change the tokens and that these do not
# implement: refused unless left at the default (null always is).
_UNSUPPORTED = {
    "continue_final_message": lambda v: v is False,
    "chat_template": lambda v: False,
    "chat_template_kwargs": lambda v: v == {},
    "tools": lambda v: v == [],
    "mm_processor_kwargs": lambda v: v == {},
}


class Tokenization:
    def __init__(self, config: BatonConfig, limits: Limits, model_dir: Path | None) -> None:
        """``model_dir``: the resolved model directory (None: resolved on first use)."""
        self.config = config
        self.limits = limits
        self._model_dir = model_dir
        self._encoder: PromptEncoder | None = None
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-tokenize")

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{model?, prompt | messages, add_special_tokens?, add_generation_prompt?,
        return_token_strs?}`` → ``{count, max_model_len, tokens, token_strs}``."""
        check_model(body, self.config)
        for name, is_default in _UNSUPPORTED.items():
            if body.get(name) is not None and not is_default(body[name]):
                raise invalid(f"{name} is not supported by this server", name)
        chat = body.get("messages") is not None
        if chat == (body.get("prompt") is not None):
            raise invalid("exactly one of prompt and messages is required")
        # vLLM's defaults: a prompt gets the special tokens HF adds to text (as a completion
        # does); a chat only what its template writes (as a chat completion does).
        special = flag(body, "add_special_tokens", default=not chat)
        generation_prompt = flag(body, "add_generation_prompt", default=True)
        return_strs = flag(body, "return_token_strs", default=False)
        if chat:
            messages = messages_of(body.get("messages"))
        elif isinstance(body["prompt"], str):
            prompt = text_of(body["prompt"], "prompt")
        else:
            raise invalid("prompt must be a string", "prompt")
        encoder = await self._loaded()

        def run() -> tuple[list[int], list[str] | None]:
            if chat:
                text = encoder.render_chat(messages, add_generation_prompt=generation_prompt)
            else:
                text = prompt
            ids = encoder.tokenize(text, add_special_tokens=special)
            strs = list(encoder.tokenizer.convert_ids_to_tokens(ids)) if return_strs else None
            return ids, strs

        ids, strs = await self._call(run)
        return {
            "count": len(ids),
            "max_model_len": self.limits.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{model?, tokens}`` → ``{prompt}``: the text, special tokens included."""
        check_model(body, self.config)
        if body.get("tokens") is None:
            raise invalid("tokens is required: a list of token ids", "tokens")
        return {"prompt": await self.decode(token_ids_of(body["tokens"], "tokens"))}

    async def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens included (also an echoed completion's prompt
        given as token ids, as vLLM echoes it)."""
        encoder = await self._loaded()
        text: str = await self._call(lambda: encoder.decode(ids))
        return text

    async def _loaded(self) -> PromptEncoder:
        async with self._lock:
            if self._encoder is None:
                self._encoder = await self._call(self._load)
            return self._encoder

    def _load(self) -> PromptEncoder:
        # Imported here: transformers costs seconds and memory a gateway may never need.
        from services.shell.common import resolve_model_dir
        from services.tokenizer.core import PromptEncoder

        model_dir = self._model_dir or resolve_model_dir(self.config)
        return PromptEncoder(model_dir, self.limits)

    async def _call(self, fn: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn)
        except ProtocolError as exc:  # the encoder's refusals: a chat template, the vocabulary
            param = exc.message.split(" ", 1)[0]
            raise invalid(exc.message, param if param in ("messages", "tokens") else None) from None
