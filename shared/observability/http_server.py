"""The per-service HTTP endpoint: ``/metrics``, ``/health`` and ``/ready`` on one port.

A few dozen lines of asyncio instead of a web framework: three fixed GET routes, one response per
connection (``Connection: close``), read limits and a read timeout so a slow or malformed client
costs one short-lived task and nothing else. It runs on the service's event loop, so scrapes see
the same state the service does and need no locking.

- ``/health``  200 while the process runs (liveness; the Docker HEALTHCHECK).
- ``/ready``   200 when ``ready()`` is true, else 503 (readiness: model loaded, consuming).
- ``/metrics`` Prometheus text format of the process's metrics registry.

``python -m shared.observability.http_server [--port N] [PATH]`` probes a running server
(stdlib only): exit 0
on 200, 1 otherwise. The port defaults to ``BATON_METRICS_PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from shared.observability.metrics import Metrics

log = structlog.get_logger(__name__)

# Prometheus text exposition format, as prometheus_client.CONTENT_TYPE_LATEST.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_LINE_BYTES = 8192  # request line and each header line
MAX_HEADERS = 100
READ_TIMEOUT_S = 10.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class _BadRequest(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


async def start_metrics_server(
    port: int,
    metrics: Metrics,
    ready: Callable[[], bool],
    host: str = "0.0.0.0",
) -> asyncio.Server | None:
    """Serve /metrics, /health and /ready on ``host:port``; port 0 means no server (None).

    Close it with ``server.close(); await server.wait_closed()``.
    """
    if port == 0:
        return None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await asyncio.wait_for(_read_request(reader), READ_TIMEOUT_S)
            status, content_type, body = _route(method, path, metrics, ready)
        except _BadRequest as exc:
            status, content_type, body = exc.status, "text/plain", _REASONS[exc.status].encode()
            method = "GET"
        except asyncio.TimeoutError:  # an alias of TimeoutError from 3.11 on
            status, content_type, body, method = 408, "text/plain", b"Request Timeout", "GET"
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()
            return
        headers = [
            f"HTTP/1.1 {status} {_REASONS[status]}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        if status == 405:
            headers.append("Allow: GET, HEAD")
        head = ("\r\n".join(headers) + "\r\n\r\n").encode("ascii")
        try:
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host, port, limit=MAX_LINE_BYTES)
    log.info("metrics server listening", host=host, port=port)
    return server


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """Read the request line and headers; return (method, path without the query string)."""
    line = await _read_line(reader, 400)
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise _BadRequest(400)
    for _ in range(MAX_HEADERS):
        if await _read_line(reader, 431) in (b"", b"\r\n", b"\n"):
            break
    else:
        raise _BadRequest(431)
    method = parts[0].decode("ascii", "replace")
    path = parts[1].decode("ascii", "replace").split("?", 1)[0]
    return method, path


async def _read_line(reader: asyncio.StreamReader, too_long_status: int) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError as exc:
        raise _BadRequest(too_long_status) from exc
    except asyncio.IncompleteReadError as exc:
        if exc.partial:  # the client hung up mid-line
            raise _BadRequest(400) from exc
        return b""


def _route(
    method: str, path: str, metrics: Metrics, ready: Callable[[], bool]
) -> tuple[int, str, bytes]:
    if path not in ("/metrics", "/health", "/ready"):
        return 404, "text/plain", b"not found\n"
    if method not in ("GET", "HEAD"):
        return 405, "text/plain", b"method not allowed\n"
    if path == "/metrics":
        try:
            return 200, METRICS_CONTENT_TYPE, metrics.render()
        except Exception:  # a failing collector must not take /health and /ready down with it
            log.exception("metrics collection failed")
            return 500, "text/plain", b"metrics collection failed\n"
    if path == "/health":
        return 200, "text/plain", b"ok\n"
    try:
        is_ready = ready()
    except Exception:
        log.exception("readiness check failed")
        is_ready = False
    return (200, "text/plain", b"ready\n") if is_ready else (503, "text/plain", b"not ready\n")


def probe(
    port: int, path: str = "/health", host: str = "127.0.0.1", timeout: float = 3.0
) -> int | None:
    """GET ``path`` on a local metrics server; return the HTTP status, None if nothing answered."""
    # No proxies: an HTTP(S)_PROXY in the container's environment must not capture localhost.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{host}:{port}{path}", timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def read_metrics(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> dict[str, float]:
    """Scrape ``/metrics`` into ``{"name{label=value,...}": value}`` (labels sorted; no braces
    without labels). ``model_name`` is left out of the keys: a process serves one model.
    Raises ``OSError`` when nothing answers."""
    return read_metrics_url(f"http://{host}:{port}/metrics", timeout)


def read_metrics_url(url: str, timeout: float = 5.0) -> dict[str, float]:
    """:func:`read_metrics` of any URL serving the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    from shared.observability.collectors import MODEL_LABEL

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != MODEL_LABEL)
            values[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return values


def main(argv: list[str] | None = None) -> int:
    from shared.config import BatonConfig

    parser = argparse.ArgumentParser(description="Probe a Baton service's HTTP endpoint.")
    parser.add_argument("path", nargs="?", default="/health")
    parser.add_argument("--port", type=int, default=None, help="default: BATON_METRICS_PORT")
    args = parser.parse_args(argv)
    port = args.port if args.port is not None else BatonConfig.from_env().metrics_port
    if port == 0:
        print("BATON_METRICS_PORT is 0: this service serves no health endpoint", file=sys.stderr)
        return 1
    status = probe(port, args.path)
    print(f"GET {args.path} on port {port}: {status or 'no answer'}")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
