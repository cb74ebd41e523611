"""Engine benchmarks and profiles, in process and without a broker: decode steps and prefill
waves by op, the roofline, long context, KV cache dtypes and transports, memory, parity of real
weights."""
