"""Flow control between the services: admission at the tokenizer, default deadlines, each
consumer's prefetch window, prefill intake slowed or paused by decode's backlog and the spill
store. Fed numbers (broker depths, the engines' :class:`~shared.engine.load.EngineLoad`), it
answers with decisions; the services apply them (docs/scheduling.md).

Batch scheduling inside one engine (which sequences run in a step, preemption) is
``shared/scheduling``.
"""
