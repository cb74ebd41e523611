"""The engine core: synchronous, broker-free prefill and decode engines.

A service shell feeds an engine through four verbs — ``add``, ``abort``, ``step`` and (prefill)
``release`` — and publishes what ``step`` returns. Nothing here knows about RabbitMQ or asyncio;
the parity suite drives these same objects without a broker (``tests/test_parity.py``).
"""

# Modules: engine (the shared base), prefill, decode, outputs (plain data), limits (the length
# and stop rules). Nothing is imported here so that the schedulers can use ``limits``.
