"""Schedulers: own the queues and the token budgets; call the BlockManager through its verbs.

Synchronous and broker-free (tested without RabbitMQ); the service shells feed them.
"""

from shared.scheduling.decode_scheduler import DecodeScheduler, DecodeStep
from shared.scheduling.prefill_scheduler import PrefillBatch, PrefillScheduler

__all__ = ["DecodeScheduler", "DecodeStep", "PrefillBatch", "PrefillScheduler"]
