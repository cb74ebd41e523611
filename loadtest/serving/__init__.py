"""Serving benchmarks: a spawned or running Baton driven through the broker or its HTTP gateway
(bench and its modes, serve-bench against `vllm serve`, the gateway's overhead, exactly-once),
the baselines they run beside it (vLLM, llama.cpp, HF), the workloads and the Locust users."""
