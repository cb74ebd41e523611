"""Fault tools: the chaos harness (kills, broker alarms) with its reply log, the bad-input fuzzer,
and burst onset."""
