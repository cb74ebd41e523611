"""The Starlette application: routes, bearer auth, body limit, error JSON, HTTP metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, and vLLM's
``POST /tokenize``, ``POST /detokenize`` (behind the API key when one is set: they spend the
server's CPU), and ``GET /health``, ``GET /metrics``, ``GET /version`` (never behind it: probes
and scrapers carry no key; none reveals a prompt). Every error, including a 404 or 405 from the
router, is OpenAI's error JSON.
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.metadata
import json
import time
import uuid
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.api_requests import parse_chat, parse_completion, served_model_id
from services.gateway.errors import ApiError, internal, invalid
from services.gateway.exchange import SCOPE_STATUS, SCOPE_T0, Exchange, send_error
from services.gateway.metrics import GatewayMetrics, route_label
from services.gateway.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from services.gateway.tokenization import Tokenization
from shared.client import BatonClient
from shared.config import BatonConfig
from shared.limits import Limits
from shared.observability.http_server import METRICS_CONTENT_TYPE

log = structlog.get_logger(__name__)


def create_app(
    config: BatonConfig,
    limits: Limits,
    client: BatonClient,
    metrics: GatewayMetrics,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> ASGIApp:
    api = _Api(config, limits, client, metrics, defaults)
    app = Starlette(
        routes=[
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/tokenize", api.tokenize, methods=["POST"]),
            Route("/detokenize", api.detokenize, methods=["POST"]),
            Route("/version", api.version, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
        ],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _unhandled,  # Starlette re-raises after it; _Metered logs it once
        },
    )
    return _Metered(app, metrics)


class _Api:
    def __init__(
        self,
        config: BatonConfig,
        limits: Limits,
        client: BatonClient,
        metrics: GatewayMetrics,
        defaults: SamplingDefaults,
    ) -> None:
        self.config = config
        self.limits = limits
        self.defaults = defaults
        self.client = client
        self._metrics = metrics
        self.model = served_model_id(config)
        self.created = int(time.time())
        self._key = config.api_key.encode()
        self.tokenization = Tokenization(config, limits, model_dir=None)

    async def completions(self, request: Request) -> Exchange:
        self._authorize(request)
        req = parse_completion(await self._json(request), self.config, self.defaults)
        if req.options.echo and req.echo_text is None:  # a prompt of token ids: its text
            text = await self.tokenization.decode(req.baton["prompt_token_ids"])
            req = dataclasses.replace(req, echo_text=text)
        return Exchange(self.client, req, f"cmpl-{uuid.uuid4().hex}", self._metrics)

    async def chat_completions(self, request: Request) -> Exchange:
        self._authorize(request)
        req = parse_chat(await self._json(request), self.config, self.limits, self.defaults)
        return Exchange(self.client, req, f"chatcmpl-{uuid.uuid4().hex}", self._metrics)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "baton",
            "root": self.model,
            "max_model_len": self.limits.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> Response:
        return JSONResponse(await self.tokenization.tokenize(await self._json_object(request)))

    async def detokenize(self, request: Request) -> Response:
        return JSONResponse(await self.tokenization.detokenize(await self._json_object(request)))

    async def version(self, _request: Request) -> Response:
        return JSONResponse({"version": baton_version()})

    async def health(self, _request: Request) -> Response:
        # Liveness, like every service's /health: the process serves HTTP. A broker outage
        # shows as 503s on the API routes (the client library reconnects by itself).
        return PlainTextResponse("ok\n")

    async def metrics(self, _request: Request) -> Response:
        return Response(self._metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def _authorize(self, request: Request) -> None:
        if not self._key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: response timing must not reveal how much of a key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise ApiError(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error", "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def _json_object(self, request: Request) -> dict[str, Any]:
        """An authorized request's body, which must be a JSON object."""
        self._authorize(request)
        body = await self._json(request)
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        return body

    async def _json(self, request: Request) -> Any:
        limit = self.config.gateway_max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)  # refused before a byte of it is read
        body = bytearray()
        try:
            async for chunk in request.stream():  # chunked uploads have no length to trust
                body += chunk
                if len(body) > limit:
                    raise _too_large(len(body), limit)
        except ClientDisconnect:
            raise invalid("the client disconnected while sending the body") from None
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise invalid(
                f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from None


def baton_version() -> str:
    """The installed distribution's version (pyproject.toml), as vLLM's ``/version`` answers
    with its own."""
    try:
        return importlib.metadata.version("baton")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "0+unknown"


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413, f"the request body of {size}+ bytes exceeds the limit of {limit} bytes "
        "(BATON_GATEWAY_MAX_BODY_BYTES)", "invalid_request_error", "request_too_large",
    )  # fmt: skip


async def _api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def _unhandled(_request: Request, _exc: Exception) -> Response:
    err = internal()
    return JSONResponse(err.body(), err.status)


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error", code)
    return JSONResponse(err.body(), err.status, headers=dict(exc.headers or {}))


class _Metered:
    """Outermost ASGI layer: stamps the arrival time, counts every response by route and status,
    and turns anything that escaped the handlers into a 500 in OpenAI's format."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = scope[SCOPE_T0] = time.perf_counter()
        status = 0

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.requests_in_flight.inc()
        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            log.exception("unhandled error in the gateway", path=scope["path"])
            if status == 0:
                await send_error(send_counted, internal())
            else:
                status = 500
        finally:
            self.metrics.requests_in_flight.dec()
            route = route_label(scope["path"])
            counted = scope.get(SCOPE_STATUS, status)
            self.metrics.http_requests.labels(route=route, status=str(counted)).inc()
            self.metrics.http_request_duration.labels(route).observe(time.perf_counter() - t0)
