"""The gateway service: an OpenAI-compatible HTTP front over Baton's request queue.

A fifth service beside tokenizer, prefill, decode and detokenizer, and the thinnest: one
:class:`BatonClient` (one AMQP connection, one reply queue shared by every HTTP request) and an
HTTP server on the same event loop. No model, no tokenizer: requests go to ``baton.requests``
as the contract says, and the tokenizer service applies the chat template. Of the model it reads
``config.json`` only, for its length (``Limits``: ``/v1/models``, a chat's default
``max_tokens``).

Why Starlette on uvicorn: Starlette is a small, well-kept ASGI toolkit (routing, request/header
parsing, error handlers, nothing else), the base FastAPI is built on; uvicorn, with httptools'
parser and uvloop, is the most used ASGI server and adds tens of microseconds per request. The
gateway needs neither FastAPI's validation layer (the OpenAI dialect is checked by hand, with
OpenAI's error JSON) nor a framework's own streaming helpers: :class:`Exchange` is a plain ASGI
response, so disconnect handling is explicit. aiohttp would do as well; ASGI keeps the app
portable to any ASGI server (hypercorn, granian) should one serve better.

The server is started on a socket bound here (so a taken port is a clear ``OSError`` and port
0 yields a free one) and without uvicorn's own signal handling: ``run_until_signalled`` (or
whoever runs the service) owns SIGINT/SIGTERM and calls :meth:`GatewayService.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Iterator

import structlog
import uvicorn

from services.gateway.api_requests import served_model_id
from services.gateway.app import create_app
from services.gateway.metrics import GatewayMetrics
from services.gateway.sampling_defaults import SamplingDefaults
from services.shell.common import resolve_model_dir
from shared.client import BatonClient, BatonUnavailable
from shared.config import BatonConfig
from shared.limits import Limits

log = structlog.get_logger(__name__)

# On stop, requests in flight get this long to finish; then they are cancelled (and with them
# their Baton requests, through the client library's cancel-on-abandon).
GRACEFUL_SHUTDOWN_S = 10.0


class GatewayConfigError(ValueError):
    """The gateway refuses this configuration (e.g. a public bind without an API key)."""


def check_exposure(config: BatonConfig) -> None:
    """Refuse to serve a non-loopback address without an API key, unless explicitly allowed."""
    if config.api_key or config.gateway_allow_no_auth or is_loopback(config.gateway_host):
        return
    raise GatewayConfigError(
        f"refusing to serve on {config.gateway_host!r} without authentication: anyone who can "
        "reach it could use the model. Set BATON_API_KEY (clients then send "
        "'Authorization: Bearer <key>'), bind 127.0.0.1, or set BATON_GATEWAY_ALLOW_NO_AUTH=1 "
        "if a proxy in front of the gateway authenticates."
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # any other name may resolve anywhere: not loopback
        return False


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn would install its own SIGINT/SIGTERM handlers over the event loop's; the
        # service's runner owns signals and calls GatewayService.stop().
        yield


class GatewayService:
    name = "gateway"

    def __init__(
        self,
        config: BatonConfig,
        client: BatonClient | None = None,
        limits: Limits | None = None,
        defaults: SamplingDefaults | None = None,
    ) -> None:
        """``limits``: default from the model's ``config.json`` (as the tokenizer's);
        ``defaults``: from its ``generation_config.json`` as ``BATON_GENERATION_CONFIG`` says."""
        check_exposure(config)
        self.config = config
        if limits is None or defaults is None:
            model_dir = resolve_model_dir(config)
            limits = limits or Limits.for_model_dir(config, model_dir)
            defaults = defaults or SamplingDefaults.load(config.generation_config, model_dir)
        self.limits = limits
        self.defaults = defaults
        self.metrics = GatewayMetrics(served_model_id(config))
        self.client = client  # given: owned by the caller (tests); None: connected in start()
        self._owns_client = client is None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None  # the bound port (gateway_port may be 0)

    async def start(self) -> None:
        # Bound first: a taken port fails at once, not after waiting for the broker.
        sock = _bind(self.config.gateway_host, self.config.gateway_port)
        self.port = sock.getsockname()[1]
        if self.client is None:
            try:
                self.client = await _connect(self.config.amqp_url)
            except BaseException:
                sock.close()
                raise
        app = create_app(self.config, self.limits, self.client, self.metrics, self.defaults)
        server = _Server(
            uvicorn.Config(
                app,
                log_config=None,  # keep the process's logging (structlog) as configured
                access_log=False,  # the metrics count every request; errors are logged
                lifespan="off",
                ws="none",
                server_header=False,
                timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
            )
        )
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():  # it failed to start: surface why
                self._task.result()
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        log.info(
            "gateway listening",
            host=self.config.gateway_host,
            port=self.port,
            model=served_model_id(self.config),
            auth=bool(self.config.api_key),
        )

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._task, GRACEFUL_SHUTDOWN_S + 5.0)
            except asyncio.TimeoutError:
                log.warning("HTTP server did not stop in time")
        if self.client is not None and self._owns_client:
            await self.client.close()  # waits for the cancels of abandoned requests


async def _connect(url: str, attempts: int = 30, delay_s: float = 1.0) -> BatonClient:
    """Like the other services' broker connect: the broker may come up after the gateway."""
    for attempt in range(1, attempts + 1):
        try:
            return await BatonClient.connect(url)
        except BatonUnavailable as exc:
            if attempt == attempts:
                raise
            log.warning("broker not reachable yet", attempt=attempt, error=str(exc))
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"gateway cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.setblocking(False)
    return sock


def build(config: BatonConfig) -> GatewayService:
    """The service registry's entry point (``services.shell.common.Service`` protocol)."""
    return GatewayService(config)
