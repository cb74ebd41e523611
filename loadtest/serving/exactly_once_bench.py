"""What exactly-once costs the broker: replies published and inputs acked, by confirms or in
transactions, in messages per second on this machine's RabbitMQ.

    python -m loadtest exactly-once                 # groups of 1, 8, 64; 3 rounds
    python -m loadtest exactly-once --json tx.json

The detokenizer's pattern: take a group of input messages, publish one persistent reply per
input, then settle the inputs. Two ways, run interleaved in rounds (the machine is shared):

- ``confirm`` (before): publish with publisher confirms, await them together, then ack the
  inputs — a process killed between the confirm and the ack answers again after its restart;
- ``tx`` (now): publish and ack on the consume channel inside ``tx.select``, then ``tx.commit``
  — all or nothing (services/shell/tx_outbox.py).

Group size is what one batch of the detokenizer holds (one per request at low load; dozens
under load). Prints messages/s (replies) per way and group, and tx/confirm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aio_pika

from services.launcher import fresh_vhost
from shared.client.async_client import default_amqp_url

BODY = b"x" * 200  # about a token reply


async def one_run(url: str, way: str, group: int, num_messages: int) -> float:
    """Replies per second for ``num_messages`` inputs settled ``group`` at a time."""
    conn = await aio_pika.connect(url)
    try:
        pub = await conn.channel(publisher_confirms=True)
        inbox = await pub.declare_queue(f"bench.in.{way}.{group}", durable=True)
        replies = await pub.declare_queue(f"bench.out.{way}.{group}", durable=True)
        await inbox.purge()
        await replies.purge()
        props = aio_pika.Message(b"", delivery_mode=aio_pika.DeliveryMode.PERSISTENT).properties
        await asyncio.gather(
            *(
                pub.default_exchange.publish(
                    aio_pika.Message(BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=inbox.name,
                )
                for _ in range(num_messages)
            )
        )
        sub = await conn.channel(publisher_confirms=False)
        await sub.set_qos(prefetch_count=num_messages)
        got: asyncio.Queue[Any] = asyncio.Queue()
        consumer = await sub.get_queue(inbox.name)
        tag = await consumer.consume(got.put)
        channel = await sub.get_underlay_channel()
        confirm = await pub.get_underlay_channel()
        if way == "tx":
            await channel.tx_select()
        t0 = time.perf_counter()
        for _ in range(num_messages // group):
            batch = [await got.get() for _ in range(group)]
            if way == "tx":
                for _ in batch:
                    await channel.basic_publish(BODY, routing_key=replies.name, properties=props)
                for d in batch:
                    await d.ack()
                await channel.tx_commit()
            else:
                await asyncio.gather(
                    *(
                        confirm.basic_publish(BODY, routing_key=replies.name, properties=props)
                        for _ in batch
                    )
                )
                for d in batch:
                    await d.ack()
        elapsed = time.perf_counter() - t0
        await consumer.cancel(tag)
        await inbox.delete(if_unused=False, if_empty=False)
        await replies.delete(if_unused=False, if_empty=False)
        return (num_messages // group) * group / elapsed
    finally:
        await conn.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, list[float]]] = {}
    with fresh_vhost(args.url, prefix="baton-bench-tx") as url:
        for r in range(args.rounds):
            for group in args.groups:
                for way in ("confirm", "tx") if r % 2 == 0 else ("tx", "confirm"):
                    rate = await one_run(url, way, group, args.messages)
                    results.setdefault(str(group), {}).setdefault(way, []).append(rate)
                    print(f"round {r} group {group:3d} {way:8s} {rate:8.0f} msg/s", file=sys.stderr)
    table = {}
    for group, ways in results.items():
        confirm, tx = statistics.median(ways["confirm"]), statistics.median(ways["tx"])
        table[group] = {
            "confirm": round(confirm),
            "tx": round(tx),
            "tx/confirm": round(tx / confirm, 2),
        }
    return {"messages": args.messages, "rounds": args.rounds, "median_msgs_per_s": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=default_amqp_url())
    p.add_argument("--groups", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--messages", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(f"{'group':>5}  {'confirm':>8}  {'tx':>8}  tx/confirm  (replies/s, median)")
    for group, row in report["median_msgs_per_s"].items():
        print(f"{group:>5}  {row['confirm']:>8}  {row['tx']:>8}  {row['tx/confirm']:>10}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
