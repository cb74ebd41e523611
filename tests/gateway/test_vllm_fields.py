"""vLLM's request fields (honoured, refused or ignored: one table, and docs/gateway.md agrees)
and vLLM's /tokenize, /detokenize and /version, against the tokenizer service's own output."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import httpx
import openai
import pytest

from services.gateway.api_requests import parse_chat, parse_completion
from services.gateway.errors import ApiError
from services.gateway.request_fields import (
    CHAT_OFF,
    COMPLETION_OFF,
    HONOURED,
    IGNORED,
    SAMPLING_FIELDS,
    SPECIAL,
)
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.service import GatewayService
from services.shell.common import resolve_model_dir
from services.tokenizer.core import PromptEncoder
from shared.config import BatonConfig
from shared.limits import Limits
from shared.wire.messages import RequestMsg, SamplingParams
from tests.gateway.conftest import API_KEY
from tests.gateway.fakes import FakeBaton

CONFIG = BatonConfig()
LIMITS = Limits.build(CONFIG, max_position_embeddings=4096)
CHAT = [{"role": "user", "content": "hi"}]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
VLLM_FIELDS = {
    "min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "min_tokens": 3, "stop_token_ids": [7, 9],
    "include_stop_str_in_output": True,
}  # fmt: skip


def test_vllm_sampling_fields_map_onto_baton() -> None:
    for parse in (
        lambda b: parse_completion({"prompt": "x", **b}, CONFIG),
        lambda b: parse_chat({"messages": CHAT, **b}, CONFIG, LIMITS),
    ):
        baton = parse(VLLM_FIELDS).baton
        assert {k: baton[k] for k in VLLM_FIELDS} == VLLM_FIELDS
        plain = parse({}).baton  # none given: none sent, Baton's neutral defaults apply
        assert not set(VLLM_FIELDS) & set(plain)
        neutral = parse({"stop_token_ids": [], "include_stop_str_in_output": False}).baton
        assert "stop_token_ids" not in neutral and "include_stop_str_in_output" not in neutral


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_p", "0.1"), ("repetition_penalty", True), ("min_tokens", 1.5),
     ("stop_token_ids", [1, "2"]), ("stop_token_ids", 3), ("include_stop_str_in_output", 1)],
)  # fmt: skip
def test_vllm_sampling_fields_are_type_checked(field: str, value: object) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x", field: value}, CONFIG)
    assert (info.value.status, info.value.param) == (400, field)


def test_every_unsupported_field_is_refused_by_name_and_its_default_accepted() -> None:
    settings = {True: True, False: False}
    for chat, table in ((False, COMPLETION_OFF), (True, CHAT_OFF)):
        base = {"messages": CHAT} if chat else {"prompt": "x"}

        def parse(extra: dict[str, object], chat: bool = chat, base: dict = base) -> object:
            body = {**base, **extra}
            return parse_chat(body, CONFIG, LIMITS) if chat else parse_completion(body, CONFIG)

        for name, is_default in table.items():
            parse({name: None})  # null is always "left off"
            value = next(
                (v for v in (1, 0.5, "x", [1], {"a": 1}, True, False) if not is_default(v)),
            )
            with pytest.raises(ApiError) as info:
                parse({name: value})
            assert (info.value.status, info.value.param) == (400, name), (name, value)
            accepted = [v for v in (0, 1, "", [], {}, ["text"], "none", *settings) if is_default(v)]
            for v in accepted:
                parse({name: v})
    for name in IGNORED:
        parse_completion({"prompt": "x", name: "anything"}, CONFIG)


def test_generation_config_min_p_and_repetition_penalty_are_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        '{"repetition_penalty": 1.1, "min_p": 0.05, "presence_penalty": 0.3}'
    )
    defaults = SamplingDefaults.load("auto", tmp_path)
    baton = parse_chat({"messages": CHAT}, CONFIG, LIMITS, defaults).baton
    assert (baton["repetition_penalty"], baton["min_p"]) == (1.1, 0.05)
    assert "presence_penalty" not in baton  # vLLM does not take it as a default either
    own = parse_chat({"messages": CHAT, "repetition_penalty": 1.0}, CONFIG, LIMITS, defaults)
    assert own.baton["repetition_penalty"] == 1.0


def test_docs_table_names_every_field() -> None:
    text = DOCS.read_text()
    table = text[text.index("## Request fields") :]
    table = table[: table.index("\n## ", 4)]
    named = set(re.findall(r"`([a-z_.]+)`", table))
    fields = {n for n, _ in SAMPLING_FIELDS} | set(HONOURED) | set(IGNORED) | set(SPECIAL)
    fields |= set(CHAT_OFF) | set(COMPLETION_OFF)
    assert fields - named == set()


# --- /tokenize, /detokenize, /version ------------------------------------------------------


@pytest.fixture(scope="module")
def encoder(offline: GatewayService) -> PromptEncoder:
    """The tokenizer service's own encoder of the offline gateway's model: the reference."""
    model_dir = resolve_model_dir(offline.config)
    return PromptEncoder(model_dir, offline.limits)


async def test_tokenize_is_the_tokenizer_services_encoding(
    baton: FakeBaton, offline: GatewayService, offline_url: str, encoder: PromptEncoder
) -> None:
    prompt = "héllo wörld — 你好 🙂"
    want = encoder.encode(RequestMsg("r", SamplingParams(), prompt=prompt))
    chat_want = encoder.encode(RequestMsg("r", SamplingParams(), messages=(("user", prompt),)))
    async with httpx.AsyncClient(base_url=offline_url) as http:
        r = await http.post("/tokenize", json={"model": "smollm2-135m-instruct", "prompt": prompt})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "count": len(want), "max_model_len": offline.limits.max_model_len, "tokens": want,
            "token_strs": None,
        }  # fmt: skip
        r = await http.post("/tokenize", json={"messages": [{"role": "user", "content": prompt}]})
        assert r.json()["tokens"] == chat_want
        body = {"messages": [{"role": "user", "content": prompt}], "add_generation_prompt": False}
        shorter = (await http.post("/tokenize", json=body)).json()["tokens"]
        assert chat_want[: len(shorter)] == shorter and len(shorter) < len(chat_want)
        r = await http.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})
        assert r.json()["token_strs"] == encoder.tokenizer.convert_ids_to_tokens(r.json()["tokens"])
        r = await http.post("/detokenize", json={"tokens": want})
        assert r.status_code == 200 and r.json() == {"prompt": encoder.tokenizer.decode(want)}
        assert prompt in r.json()["prompt"]
    assert not baton.calls  # answered by the gateway alone


async def test_tokenize_refusals(baton: FakeBaton, offline_url: str) -> None:
    cases = [
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{x}}"}, 400, "chat_template"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ]
    async with httpx.AsyncClient(base_url=offline_url) as http:
        for path, body, status, param in cases:
            r = await http.post(path, json=body)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)


async def test_version_is_open_and_tokenize_needs_the_key(offline_keyed: str) -> None:
    async with httpx.AsyncClient(base_url=offline_keyed) as http:
        r = await http.get("/version")
        assert r.status_code == 200
        assert r.json() == {"version": importlib.metadata.version("baton")}
        assert (await http.post("/tokenize", json={"prompt": "x"})).status_code == 401
        assert (await http.post("/detokenize", json={"tokens": [1]})).status_code == 401
        keyed = {"Authorization": f"Bearer {API_KEY}"}
        r = await http.post("/tokenize", json={"prompt": "x"}, headers=keyed)
        assert r.status_code == 200 and r.json()["count"] >= 1


async def test_openai_client_sends_vllm_fields_through(baton: FakeBaton, offline_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=offline_url + "/v1", api_key="unused", max_retries=0)
    await client.completions.create(
        model="smollm2-135m-instruct", prompt="x", presence_penalty=0.5, frequency_penalty=0.25,
        extra_body={"repetition_penalty": 1.1, "min_p": 0.1, "min_tokens": 2,
                    "stop_token_ids": [5], "include_stop_str_in_output": True},
    )  # fmt: skip
    (call,) = baton.calls
    assert {k: call[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                 "min_p", "min_tokens", "stop_token_ids",
                                 "include_stop_str_in_output")} == {
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
        "min_p": 0.1, "min_tokens": 2, "stop_token_ids": [5], "include_stop_str_in_output": True,
    }  # fmt: skip
