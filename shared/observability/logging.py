"""structlog setup: JSON lines in containers (or when not a tty), readable lines in a terminal.

Services bind ``request_id`` on every line about a request: ``log.bind(request_id=rid)`` or
``structlog.contextvars.bound_contextvars(request_id=rid)`` around the work.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


def configure_logging(level: str = "info", fmt: str = "auto", service: str | None = None) -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if service:
        processors.insert(0, _add_service(service))
    if use_json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    # getLevelName maps a level's name to its number (getLevelNamesMapping is 3.11+); an
    # unknown name comes back as a string.
    number = logging.getLevelName(level.upper())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            number if isinstance(number, int) else logging.INFO
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries that use stdlib logging (aio-pika, aiormq) stay quiet below WARNING.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def _add_service(service: str) -> structlog.types.Processor:
    def add(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("service", service)
        return event

    return add
