"""``python -m services.gateway [--gateway-port N ...]``: run the gateway alone.

The same flags and ``BATON_*`` variables as ``python -m services`` (shared/config.py). Exit
status 2 when the configuration is refused (e.g. a public bind without BATON_API_KEY).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.gateway.service import GatewayConfigError, build
from services.shell.common import run_until_signalled
from shared.config import BatonConfig
from shared.observability.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    BatonConfig.add_arguments(parser)
    config = BatonConfig.from_args(parser.parse_args(argv))
    configure_logging(config.log_level, config.log_format, service="gateway")
    try:
        service = build(config)
    except GatewayConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(run_until_signalled(service))
    return 0


if __name__ == "__main__":
    sys.exit(main())
