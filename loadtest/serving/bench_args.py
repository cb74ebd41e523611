"""The bench's command line, and the model shapes it can build (``--model-shape``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from loadtest.serving.vllm_baseline import add_vllm_python_argument
from shared.config import REPO_ROOT

DESCRIPTION = (
    "Baton's benchmark runner: serving figures beside vLLM-CPU and HF, the floors, a profile."
)
DEFAULT_OUT = REPO_ROOT / "loadtest" / "results" / "bench.json"


@dataclass(frozen=True)
class ModelShape:
    """A random-weight model the bench builds once (shared/models/tiny/builder.py presets) and
    the workload it runs by default: (requests, prompt tokens, output tokens)."""

    preset: str  # built by loadtest.models.preset_model (its layout: loadtest.models.arch_of)
    workload: tuple[int, int, int]


SHAPES = {
    "bench": ModelShape("bench", (64, 128, 64)),
    # Qwen2-0.5B's layer shapes (a 4k vocabulary): ~360M matmul params, 1.45 GB in fp32, a
    # real-size decode step (memory-bound) and prefill (GEMM-bound). --requests 64
    # --prompt-len 256 --output-len 64 is its larger workload.
    "qwen2-0.5b": ModelShape("qwen2-0.5b", (16, 128, 32)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.serving.bench", description=DESCRIPTION)
    p.add_argument("--spawn", action="store_true", help="start `python -m services up` itself")
    p.add_argument("--url", default=None, help="AMQP URL without --spawn (env BATON_AMQP_URL)")
    p.add_argument(
        "--model",
        default=None,
        help="BATON_MODEL: a name, an HF dir or a .gguf file (default: resolve_model)",
    )
    p.add_argument(
        "--weight-format",
        default="auto",
        help="BATON_WEIGHT_FORMAT of a GGUF model: auto, packed, dequantized",
    )
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="bench",
                   help="random-weight model built (once, cached) when spawning without --model; "
                   "sets the workload's defaults")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="for Baton (BATON_DTYPE), HF generate and vLLM alike")  # fmt: skip
    p.add_argument("--num-requests", "--requests", type=int, default=None,
                   help="default: the shape's (bench 64, qwen2-0.5b 16)")  # fmt: skip
    p.add_argument("--input-len", "--prompt-len", type=int, default=None,
                   help="default: the shape's (128)")  # fmt: skip
    p.add_argument("--output-len", type=int, default=None,
                   help="default: the shape's (bench 64, qwen2-0.5b 32)")  # fmt: skip
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")  # fmt: skip
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson req/s (default: inf)")
    p.add_argument("--rates", default=None, help="sweep, e.g. 2,4,8,16 (one run per rate)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--priorities", default=None, help='priority mix, e.g. "0:0.8,5:0.2"')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="TPOT SLO in seconds")
    p.add_argument(
        "--repeats", type=int, default=3,
        help="timed runs of Baton, HF and vLLM each (new prompts / a reset prefix cache per "
        "repeat); the median counts",
    )  # fmt: skip
    p.add_argument(
        "--warmup-passes", type=int, default=1,
        help="untimed all-at-once passes of the workload's shape (other prompts) before measuring",
    )  # fmt: skip
    p.add_argument("--hf-batch", type=int, default=16)
    add_vllm_python_argument(p)
    for flag, what in (  # the parts of a run it can leave out
        ("--no-baseline", "skip HF generate"),
        ("--no-vllm", "skip the vLLM-CPU baseline"),
        ("--no-profile", "skip the profile (CPU per process, stages, broker traffic)"),
        ("--no-py-spy", "profile without py-spy (stages without metrics stay unmeasured)"),
    ):
        p.add_argument(flag, action="store_true", help=what)
    p.add_argument(
        "--broker-api-port",
        type=int,
        default=15672,
        help="RabbitMQ management API port (messages and bytes per request)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="without --spawn: the services' BATON_METRICS_PORT base, for the profile",
    )
    p.add_argument(
        "--fixed-overhead",
        action="store_true",
        help="only measure 1-token requests on an idle Baton (pipeline overhead)",
    )
    p.add_argument("--overhead-requests", type=int, default=100)
    p.add_argument("--mixed", action="store_true",
                   help="mixed workload (loadtest/serving/mixed.py); "
                   "--requests is the number of short requests per phase")  # fmt: skip
    p.add_argument("--mixed-rate", type=float, default=8.0, help="--mixed: short requests/s")
    p.add_argument("--mixed-configs", default=None,
                   help="--mixed: some of chunked,unchunked,own-cores (default: all)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads for HF and matmul")
    p.add_argument("--wait-s", type=float, default=900.0, help="client wait limit per request")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-json", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    shape = SHAPES[args.model_shape]
    for key, value in zip(("num_requests", "input_len", "output_len"), shape.workload, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args
