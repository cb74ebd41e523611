"""What Baton's metrics need beyond prometheus-client's metric types: a registry that adds
``model_name`` to every series, the device's gauges read at scrape time, and many equal
observations of a histogram at once. The metrics themselves are declared in metrics.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "baton:"
GPU_PREFIX = PREFIX + "gpu_"
MODEL_LABEL = "model_name"  # vLLM's label for the served model


class ModelRegistry(CollectorRegistry):
    """A registry whose series all carry ``model_name``, but those named in ``per_process`` and
    the device's (``baton:gpu_*``): the label is one value per process, so it is added when
    the registry is read rather than passed at every update."""

    def __init__(self, model_name: str) -> None:
        super().__init__()
        self.model_name = model_name
        self.per_process: set[str] = set()  # family names

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            if family.name in self.per_process or family.name.startswith(GPU_PREFIX):
                yield family
                continue
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            model = {MODEL_LABEL: self.model_name}
            labelled.samples = [s._replace(labels={**model, **s.labels}) for s in family.samples]
            yield labelled

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """As prometheus-client's, with ``model_name`` implied: a series is found by its other
        labels whether it carries the label or not."""
        labels = labels or {}
        if MODEL_LABEL not in labels:
            value = super().get_sample_value(name, {MODEL_LABEL: self.model_name, **labels})
            if value is not None:
                return value
        return super().get_sample_value(name, labels)


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``count`` observations of ``value`` for the price of one: a request's equal gaps
    between tokens. The same series as ``count`` calls of ``observe`` (tests/test_metrics.py)."""
    if count <= 0:
        return
    if count == 1:
        histogram.observe(value)
        return
    # prometheus-client keeps a histogram child as its sum and non-cumulative bucket counts.
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    for bucket, bound in zip(histogram._buckets, histogram._upper_bounds, strict=True):
        if value <= bound:
            bucket.inc(count)
            break


class CudaCollector(Collector):
    def __init__(self, device: str) -> None:
        import torch  # only services that run on a GPU pay for the import here

        self._torch = torch
        self._device = torch.device(device)

    def describe(self) -> list:
        # Reserve no names: register() must not touch the device, and the gpu_ names cannot
        # collide with the Metrics attributes.
        return []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        cuda = self._torch.cuda
        index = str(self._device.index if self._device.index is not None else cuda.current_device())
        free, total = cuda.mem_get_info(self._device)
        readings = [
            ("memory_allocated_bytes", "Bytes held by live tensors.",
             cuda.memory_allocated(self._device)),
            ("memory_reserved_bytes", "Bytes held by the caching allocator.",
             cuda.memory_reserved(self._device)),
            ("memory_used_perc", "Device memory in use by any process (0..1).",
             (total - free) / total),
        ]  # fmt: skip
        try:
            readings.append(
                ("utilization_perc", "Kernel-busy fraction of the last NVML sample (0..1).",
                 cuda.utilization(self._device) / 100.0)
            )  # fmt: skip
        except Exception:  # NVML (pynvml) missing or unsupported: leave it to DCGM's exporter
            pass
        for name, doc, value in readings:
            family = GaugeMetricFamily(GPU_PREFIX + name, doc, labels=["gpu"])
            family.add_metric([index], float(value))
            yield family
