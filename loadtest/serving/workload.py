"""Workloads and latency statistics shared by the benchmark runner and the Locust users.

Pure Python + numpy (no broker, no torch, no gevent), so tests and both load generators import it.

Definitions follow vLLM's ``benchmark_serving`` so figures compare across projects:
- TTFT: send → first token reply; E2E: send → terminal reply (client clock).
- TPOT = (E2E - TTFT) / (num_output_tokens - 1), per request; undefined for one-token outputs.
- ITL: gaps between successive token replies (a reply carrying several tokens is one gap).
- goodput: completed requests per second meeting both the TTFT and the TPOT SLO (DistServe).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)


# --- workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One benchmark request: what to send and when (seconds after the run starts)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0
    priority: int | None = None


def read_vocab(model_dir: Path) -> tuple[int, frozenset[int]]:
    """(vocab_size, special token ids) from a Hugging Face model directory's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    special: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(key)
        special.update(v if isinstance(v, list) else [] if v is None else [v])
    return int(cfg["vocab_size"]), frozenset(special)


def sample_lengths(
    rng: np.random.Generator, n: int, mean_len: int, range_ratio: float
) -> list[int]:
    """Lengths uniform in [mean·(1-r), mean·(1+r)] (vLLM's --random-range-ratio), at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(mean_len * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_token_ids(
    rng: np.random.Generator, n: int, vocab_size: int, exclude: Iterable[int] = ()
) -> tuple[int, ...]:
    """``n`` ids drawn uniformly from the vocabulary minus ``exclude`` (special tokens)."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude, dtype=np.int64))
    return tuple(int(t) for t in rng.choice(allowed, size=n))


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> list[float]:
    """Arrival offsets of a Poisson process of ``rate`` requests/s; ``inf`` = all at once."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request opens the run
    return [float(x) for x in np.cumsum(gaps)]


def gamma_arrivals(
    rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0
) -> list[float]:
    """Arrival offsets with gamma-distributed gaps of mean ``1/rate`` and shape ``burstiness``
    (vLLM's ``--burstiness``): 1 is a Poisson process, below 1 burstier, above 1 more even.

    ``burstiness`` 1 is :func:`poisson_arrivals` itself, so a Poisson workload draws the same
    random numbers (and so the same requests) whichever function built it."""
    if burstiness <= 0 or not math.isfinite(burstiness):
        raise ValueError(f"burstiness must be positive and finite, got {burstiness}")
    if burstiness == 1.0 or rate <= 0 or math.isinf(rate):
        return poisson_arrivals(rng, n, rate)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def make_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    *,
    seed: int = 0,
    range_ratio: float = 0.0,
    rate: float = math.inf,
    exclude_ids: Iterable[int] = (),
    priorities: Sequence[tuple[int, float]] | None = None,
    burstiness: float = 1.0,
) -> list[RequestSpec]:
    """A deterministic workload: the same arguments always give the same requests. Arrivals:
    :func:`gamma_arrivals` (``burstiness`` 1, the default, is a Poisson process)."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_requests, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_requests, output_len, range_ratio)
    excluded = tuple(exclude_ids)
    prompts = [random_token_ids(rng, n, vocab_size, excluded) for n in in_lens]
    arrivals = gamma_arrivals(rng, num_requests, rate, burstiness)
    prios: list[int | None] = [None] * num_requests
    if priorities:
        prios = [pick_weighted(rng, priorities) for _ in range(num_requests)]
    return [
        RequestSpec(p, o, a, pr)
        for p, o, a, pr in zip(prompts, out_lens, arrivals, prios, strict=True)
    ]


def parse_mix(spec: str) -> list[tuple[int, float]]:
    """``"0:0.8,5:0.2"`` → [(0, 0.8), (5, 0.2)]; a bare ``"128"`` → [(128, 1.0)].

    Weights are relative (normalised by their sum)."""
    items: list[tuple[int, float]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        value, _, weight = part.partition(":")
        w = float(weight) if weight else 1.0
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"weight must be finite and >= 0 in {part!r}")
        items.append((int(value), w))
    total = sum(w for _, w in items)
    if not items or total <= 0:
        raise ValueError(f"empty or all-zero mix {spec!r}")
    return [(v, w / total) for v, w in items]


def pick_weighted(rng: np.random.Generator, mix: Sequence[tuple[int, float]]) -> int:
    values = [v for v, _ in mix]
    weights = np.array([w for _, w in mix], dtype=np.float64)
    return int(values[int(rng.choice(len(values), p=weights / weights.sum()))])


@dataclass(frozen=True)
class LoadMix:
    """What a Locust user sends, from ``BATON_LOCUST_*`` env vars (each a :func:`parse_mix`
    spec): INPUT_LEN (default "128"), OUTPUT_LEN ("64"), PRIORITIES ("0")."""

    input_lens: tuple[tuple[int, float], ...]
    output_lens: tuple[tuple[int, float], ...]
    priorities: tuple[tuple[int, float], ...]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LoadMix:
        def mix(key: str, default: str) -> tuple[tuple[int, float], ...]:
            return tuple(parse_mix(env.get(f"BATON_LOCUST_{key}") or default))

        return cls(mix("INPUT_LEN", "128"), mix("OUTPUT_LEN", "64"), mix("PRIORITIES", "0"))

    def sample(self, rng: np.random.Generator) -> tuple[int, int, int]:
        """(input_len, output_len, priority) of the next request."""
        return (
            pick_weighted(rng, self.input_lens),
            pick_weighted(rng, self.output_lens),
            pick_weighted(rng, self.priorities),
        )


# --- per-request measurements ----------------------------------------------------------------


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, client clock)."""

    ok: bool
    num_prompt_tokens: int
    num_output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None  # error code, "timeout" for a client-side timeout
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        return tpot(self.ttft, self.e2e, self.num_output_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot": self.tpot}


def tpot(ttft: float | None, e2e: float | None, num_output_tokens: int) -> float | None:
    if ttft is None or e2e is None or num_output_tokens < 2:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default, as vLLM reports); NaN when empty."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class Stat:
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan, 0)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(float(np.mean(values)), p50, p90, p99, float(max(values)), len(values))


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, r: RequestResult) -> bool:
        """A completed request within both SLOs (a one-token output has no TPOT to miss)."""
        if not r.ok or r.ttft is None or r.ttft > self.ttft_s:
            return False
        t = r.tpot
        return t is None or t <= self.tpot_s


@dataclass(frozen=True)
class Summary:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float
    slo_attainment: float
    ttft: Stat
    tpot: Stat
    itl: Stat
    e2e: Stat
    errors: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> Summary:
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or "unknown"
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.num_output_tokens for r in done)
    in_tokens = sum(r.num_prompt_tokens for r in done)
    good = sum(1 for r in done if slo.met(r))
    dur = max(duration_s, 1e-9)
    return Summary(
        duration_s=duration_s,
        completed=len(done),
        failed=len(results) - len(done),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(done) / dur,
        output_throughput=out_tokens / dur,
        total_token_throughput=(in_tokens + out_tokens) / dur,
        goodput=good / dur,
        slo_attainment=good / len(results) if results else math.nan,
        ttft=Stat.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Stat.of([t for r in done if (t := r.tpot) is not None]),
        itl=Stat.of([x for r in done for x in r.itl]),
        e2e=Stat.of([r.e2e for r in done if r.e2e is not None]),
        errors=errors,
    )


def format_summary(s: Summary, title: str, slo: Slo) -> str:
    """A vLLM ``benchmark_serving``-style block (latencies in ms)."""
    width = 52
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: float | int, fmt: str = ".2f") -> None:
        lines.append(f"{label:<40}{value:>12{fmt}}")

    row("Successful requests:", s.completed, "d")
    row("Failed requests:", s.failed, "d")
    for code, n in sorted(s.errors.items()):
        row(f"  of which {code}:", n, "d")
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.total_input_tokens, "d")
    row("Total generated tokens:", s.total_output_tokens, "d")
    row("Request throughput (req/s):", s.request_throughput)
    row("Output token throughput (tok/s):", s.output_throughput)
    row("Total token throughput (tok/s):", s.total_token_throughput)
    row(f"Goodput (req/s, TTFT<={slo.ttft_s:g}s, TPOT<={slo.tpot_s:g}s):", s.goodput)
    row("SLO attainment (%):", 100 * s.slo_attainment)
    for name, label, stat in (
        ("TTFT", "Time to First Token", s.ttft),
        ("TPOT", "Time per Output Token (excl. 1st token)", s.tpot),
        ("ITL", "Inter-token Latency", s.itl),
        ("E2E", "End-to-end Latency", s.e2e),
    ):
        lines.append(f"{label}".center(width, "-"))
        row(f"Mean {name} (ms):", 1000 * stat.mean)
        row(f"Median {name} (ms):", 1000 * stat.p50)
        row(f"P90 {name} (ms):", 1000 * stat.p90)
        row(f"P99 {name} (ms):", 1000 * stat.p99)
    lines.append("=" * width)
    return "\n".join(lines)


def greedy_agreement(
    ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]
) -> dict[str, float]:
    """How far two systems' greedy outputs for the same prompts agree, request by request.

    ``exact``: fraction of requests with identical outputs; ``prefix``: mean fraction of each
    reference output (``theirs``) produced before the first difference. fp32 greedy decoding
    with different kernels can flip a near-tie and diverge from there, so ``prefix`` < 1 is not
    by itself a bug; a low value on the first tokens is."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} outputs against {len(theirs)}")
    if not theirs:
        return {"exact": math.nan, "prefix": math.nan, "requests": 0}
    exact, prefix = 0, 0.0
    for a, b in zip(ours, theirs, strict=True):
        pairs = zip(a, b, strict=False)
        same = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
        exact += list(a) == list(b)
        prefix += same / len(b) if b else float(not a)
    return {"exact": exact / len(theirs), "prefix": prefix / len(theirs), "requests": len(theirs)}


# --- compute ---------------------------------------------------------------------------------


def workload_flops(model_cfg: dict[str, Any], specs: Sequence[RequestSpec]) -> dict[str, float]:
    """FLOPs the workload needs at minimum, from a HF config.json (llama/qwen layouts).

    A request of n prompt and m output tokens forwards T = n + m - 1 tokens (the last sampled
    token is never fed back): 2 x matmul params per token for the layers, the LM head only
    where a token is sampled (m times), and causal attention 4·layers·heads·head_dim per
    (query, key) pair, T(T+1)/2 pairs. Embedding lookups, norms and activations are ignored.
    ``decode_matmul``: the part of ``matmul`` the decode steps do (m - 1 tokens a request, each
    through the layers and the head); ``prefill_body_matmul``: the prompts through the layers
    (the head's first token not included)."""
    h = int(model_cfg["hidden_size"])
    layers = int(model_cfg["num_hidden_layers"])
    heads = int(model_cfg["num_attention_heads"])
    kv_heads = int(model_cfg.get("num_key_value_heads") or heads)
    head_dim = int(model_cfg.get("head_dim") or h // heads)
    inter = int(model_cfg["intermediate_size"])
    vocab = int(model_cfg["vocab_size"])
    layer_params = h * (2 * heads * head_dim + 2 * kv_heads * head_dim) + 3 * h * inter
    body, head = layers * layer_params, vocab * h
    matmul = decode = prompts = attention = 0.0
    for spec in specs:
        n, m = len(spec.prompt_token_ids), spec.max_tokens
        t = n + m - 1
        matmul += 2.0 * body * t + 2.0 * head * m
        decode += 2.0 * (body + head) * max(m - 1, 0)
        prompts += 2.0 * body * n
        attention += 4.0 * layers * heads * head_dim * t * (t + 1) / 2
    return {
        "matmul_params": float(body + head),
        "matmul": matmul,
        "decode_matmul": decode,
        "prefill_body_matmul": prompts,
        "attention": attention,
        "total": matmul + attention,
    }
