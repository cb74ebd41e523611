"""Logging, Prometheus metrics and the per-service health/metrics endpoint."""
