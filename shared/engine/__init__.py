"""The engine core: synchronous, broker-free prefill and decode engines.

A service shell feeds an engine through four verbs — ``add``, ``abort``, ``step`` and (prefill)
``release`` — and publishes what ``step`` returns. Nothing here knows about RabbitMQ or asyncio;
the parity suite drives these same objects without a broker (``tests/test_parity.py``).
"""

# Modules: engine (the shared base), prefill, decode, outputs (plain data), build. The length and
# stop rules live below every engine and scheduler, in shared/limits.py.
