"""``baton``: the command an install puts on the PATH (pyproject.toml ``[project.scripts]``).

    baton serve MODEL [--served-model-name NAME] [--host HOST] [--port PORT] [flags]
    baton bench [tool] [options]           # python -m loadtest [tool] [options]

``serve`` is ``python -m services up`` with vLLM's spelling: the model (a name, a Hugging Face
directory or a .gguf file; shared/models/catalog.py) as the argument, ``--host`` / ``--port``
for the OpenAI-compatible gateway, and every other setting as the same flag ``python -m
services`` takes (``baton serve --help`` lists them, each with its ``BATON_*`` variable). The
environment still fills what the flags leave out; the flags given reach every service.
"""

from __future__ import annotations

import argparse
import sys

from shared.config import BatonConfig
from shared.config_flags import as_flags, given

PROG = "baton"
# vLLM's names for the gateway's address.
ALIASES = {"gateway_host": ("--host",), "gateway_port": ("--port",)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run every service and the OpenAI-compatible gateway (python -m services up)",
        description="Run Baton: tokenizer, prefill, decode, detokenizer and the HTTP gateway, "
        "against the broker at --amqp-url.",
    )
    serve.add_argument(
        "model",
        help="the model: a name, a Hugging Face directory or a .gguf file (BATON_MODEL; "
        "tiny-random is the built-in test model)",
    )
    BatonConfig.add_arguments(serve, aliases=ALIASES, exclude=("model",))
    commands.add_parser(
        "bench", help="benchmarks and load tools: python -m loadtest (baton bench --help)"
    )
    return parser


def serve_config(args: argparse.Namespace) -> tuple[BatonConfig, list[str]]:
    """The configuration ``serve`` runs with, and the flags its services are started with."""
    return BatonConfig.from_args(args), as_flags(given(BatonConfig, args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # everything after it is the load tools' own command line
        from loadtest.__main__ import main as loadtest_main

        return loadtest_main(argv[1:])
    args = build_parser().parse_args(argv)
    config, flags = serve_config(args)
    from services.__main__ import launch

    return launch("up", config, flags)


if __name__ == "__main__":
    sys.exit(main())
