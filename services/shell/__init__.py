"""What every service shares: broker plumbing (``broker``), the one service shell (``shell``),
the engine loop of prefill and decode (``engine_service``), the service registry (``registry``)
and the run loop (``common``)."""
