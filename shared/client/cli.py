"""Send prompts to a running Baton: ``python -m shared.client "Tell me a story" --max-tokens 32``.

Text streams to stdout as tokens arrive; a one-line summary (finish reason, tokens, client-side
TTFT/TPOT) goes to stderr; the exit code is 1 on an error reply, a timeout or no Baton.
``--demo`` sends a few built-in prompts (plain text and chat, greedy and sampled, two
priorities) at once and shows every stream live, one row per request.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from shared.client import BatonClient, BatonUnavailable, Completion, default_amqp_url
from shared.observability.logging import configure_logging
from shared.wire.messages import DoneReply, ErrorReply, TokenReply

# --- one prompt -----------------------------------------------------------------------------


def _request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
        priority=args.priority, timeout_s=args.timeout_s, wait_s=args.wait_s,
    )  # fmt: skip
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        kw["messages"] = [*system, {"role": "user", "content": args.prompt}]
    else:
        kw["prompt"] = args.prompt
    return kw


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f}ms"


async def run_one(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    async with await BatonClient.connect(args.url) as client:
        kw = _request_kwargs(args)
        if args.no_stream:
            terminal = await client.generate(**kw)
            if isinstance(terminal, ErrorReply):
                print(f"error: {terminal.code}: {terminal.message}", file=err)
                return 1
            out.write(terminal.text + "\n")
            timing = terminal.timing
            print(
                f"finish={terminal.finish_reason} tokens={terminal.usage.get('completion_tokens')}"
                f" ttft={_ms(timing.get('ttft_s'))} tpot={_ms(timing.get('tpot_s'))}"
                f" e2e={_ms(timing.get('e2e_s'))} (server timing)",
                file=err,
            )
            return 0
        c: Completion | None = None
        async for t in client.stream_timed(**kw, stream=True):
            c = c or Completion(t.reply.request_id)
            c.add(t)
            if isinstance(t.reply, TokenReply):
                out.write(t.reply.text)
                out.flush()
        assert c is not None
        if c.token_ids or c.text:
            out.write("\n")
        if c.error is not None:
            print(f"error: {c.error.code}: {c.error.message}", file=err)
            return 1
        print(
            f"finish={c.finish_reason} tokens={c.num_output_tokens} ttft={_ms(c.ttft_s)}"
            f" tpot={_ms(c.tpot_s)} e2e={_ms(c.e2e_s)}",
            file=err,
        )
        return 0


# --- demo -----------------------------------------------------------------------------------


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


DEMO_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("capital", dict(messages=_chat("What is the capital of France?"), max_tokens=32)),
    ("colors", dict(messages=_chat("Name three primary colors."), max_tokens=40)),
    ("broker", dict(
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "In one sentence, what does a message broker do?"},
        ],
        max_tokens=60, temperature=0.7, seed=1,
    )),
    ("urgent", dict(
        messages=_chat("Give me one tip for staying focused."), max_tokens=48, priority=9,
    )),
    ("haiku", dict(messages=_chat("Write a haiku about the sea."), max_tokens=40)),
    ("story", dict(
        prompt="Once upon a time, in a quiet harbour town,", max_tokens=48, temperature=0.8,
        top_p=0.9, seed=7,
    )),
    ("code", dict(prompt="def fibonacci(n):", max_tokens=48, stop=["\n\n"])),
]  # fmt: skip


@dataclass
class _Row:
    name: str
    kind: str
    priority: int
    completion: Completion
    status: str = "queued"
    started: float = field(default_factory=time.perf_counter)


def _one_line(text: str) -> str:
    return text.replace("\r", "").replace("\n", "⏎").replace("\t", " ")


class _Board:
    """One terminal row per request, redrawn in place (ANSI) when stdout is a terminal."""

    def __init__(self, rows: list[_Row], out: TextIO) -> None:
        self.rows, self.out = rows, out
        self.live = out.isatty()
        self.drawn = False
        self.last_draw = 0.0
        self.width = max(len(r.name) for r in rows)

    def line(self, r: _Row) -> str:
        cols = shutil.get_terminal_size((100, 20)).columns
        mark = {"queued": "·", "streaming": "▸", "done": "✓", "error": "✗"}[r.status]
        head = f" {mark} {r.name:<{self.width}} │ "
        text = _one_line(r.completion.text)
        room = max(10, cols - len(head) - 1)
        if len(text) > room:
            text = "…" + text[-(room - 1) :]
        return head + text

    def draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.live or (not force and now - self.last_draw < 1 / 30):
            return
        self.last_draw = now
        if self.drawn:
            self.out.write(f"\x1b[{len(self.rows)}F")
        for r in self.rows:
            self.out.write("\x1b[2K" + self.line(r) + "\n")
        self.out.flush()
        self.drawn = True


async def _demo_one(client: BatonClient, row: _Row, kw: dict[str, Any], board: _Board) -> None:
    async for t in client.stream_timed(**kw, request_id=f"demo-{row.name}-{time.time_ns()}"):
        row.completion.add(t)
        if isinstance(t.reply, TokenReply):
            row.status = "streaming"
        else:
            row.status = "done" if isinstance(t.reply, DoneReply) else "error"
            if not board.live:
                print(f"[{row.name}] {_one_line(row.completion.text)}", file=board.out)
        board.draw()


async def run_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    rows: list[_Row] = []
    for name, kw in DEMO_REQUESTS:
        kind = "chat" if "messages" in kw else "text"
        rows.append(_Row(name, kind, kw.get("priority", 0), Completion(name)))
    board = _Board(rows, out)
    print(f"Baton demo: {len(rows)} concurrent requests → {_short(args.url)}\n", file=out)
    async with await BatonClient.connect(args.url) as client:
        t0 = time.perf_counter()
        board.draw(force=True)
        jobs = [
            _demo_one(client, r, {**kw, "wait_s": args.wait_s}, board)
            for r, (_, kw) in zip(rows, DEMO_REQUESTS, strict=True)
        ]
        await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
    board.draw(force=True)
    print(file=out)
    header = f"  {'request':<10}{'kind':<6}{'prio':>5}{'tokens':>8}  {'finish':<10}"
    print(header + f"{'TTFT':>10}{'TPOT':>10}{'E2E':>10}", file=out)
    failed = 0
    for r in rows:
        c = r.completion
        finish = c.finish_reason or (c.error.code if c.error else "?")
        failed += not c.ok
        print(
            f"  {r.name:<10}{r.kind:<6}{r.priority:>5}{c.num_output_tokens:>8}  {finish:<10}"
            f"{_ms(c.ttft_s):>10}{_ms(c.tpot_s):>10}{_ms(c.e2e_s):>10}",
            file=out,
        )
    total = sum(r.completion.num_output_tokens for r in rows)
    print(f"\n  {total} tokens in {wall:.2f}s ({total / wall:.0f} tokens/s overall)", file=out)
    for r in rows:
        if r.completion.error is not None:
            print(f"  {r.name}: {r.completion.error.code}: {r.completion.error.message}", file=err)
    return 1 if failed else 0


def _short(url: str) -> str:
    return url.split("@", 1)[-1] if "@" in url else url


# --- entry point ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shared.client", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", help="the prompt (omit with --demo)")
    p.add_argument("--demo", action="store_true", help="send the built-in demo prompts at once")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat user message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--priority", type=int, default=None, help="0-9, higher is served first")
    p.add_argument("--timeout-s", type=float, default=None, help="server-side request timeout")
    p.add_argument("--wait-s", type=float, default=120.0, help="client-side wait limit")
    p.add_argument("--no-stream", action="store_true", help="one reply at the end")
    p.add_argument("--url", default=default_amqp_url(), help="AMQP URL (env BATON_AMQP_URL)")
    args = p.parse_args(argv)
    if not args.demo and args.prompt is None:
        p.error("a prompt is required (or --demo)")
    return args


async def amain(args: argparse.Namespace) -> int:
    try:
        if args.demo:
            return await run_demo(args, sys.stdout, sys.stderr)
        return await run_one(args, sys.stdout, sys.stderr)
    except BatonUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
    except asyncio.TimeoutError as exc:
        print(f"error: timed out: {exc}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("warning", "console")  # stdout carries the completions only
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
