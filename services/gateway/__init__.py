"""OpenAI-compatible HTTP gateway (``/v1/completions``, ``/v1/chat/completions`` with SSE) over
Baton's request queue; see services/gateway/service.py and docs/gateway.md."""
