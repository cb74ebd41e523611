# Baton: one image for all four services (and the Locust load generator).
#
#   GPU (default):  docker build -t baton .
#   CPU only:       docker build -t baton:cpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#
# Run one service per container: `docker run baton tokenizer|prefill|decode|detokenizer`, or all
# four as child processes of one container: `docker run baton up` (the default command).
FROM python:3.11-slim

# Empty = torch from PyPI, whose Linux wheel is the CUDA build (GPU image). Set to a PyTorch
# wheel index (…/whl/cpu, …/whl/cu126) to pin the flavour; the CPU wheel is ~10x smaller.
ARG TORCH_INDEX=""
# Optional-dependency groups of pyproject.toml baked in; `loadtest` lets the same image run Locust.
ARG EXTRAS="loadtest"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton JIT-compiles a small C launcher the first time a kernel runs on the GPU: it needs a C
# compiler and libc headers at run time, not just at build time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# Dependencies first, read from pyproject.toml (the single list), in their own layer so a source
# change does not reinstall torch. tomllib is stdlib from Python 3.11.
COPY pyproject.toml ./
RUN EXTRAS="$EXTRAS" python -c "import os, tomllib; \
p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = [e for e in os.environ['EXTRAS'].split(',') if e]; \
reqs = p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]; \
print('\n'.join(reqs))" > /tmp/requirements.txt \
    && if [ -n "$TORCH_INDEX" ]; then \
         pip install --index-url "$TORCH_INDEX" "$(grep -m1 '^torch' /tmp/requirements.txt)"; \
       fi \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself, installed editable: /app is both the import location and the repo layout,
# so shared.config.REPO_ROOT is /app, the built-in model lives at /app/models/tiny and
# `locust -f loadtest/locustfile.py` resolves from the working directory.
COPY . .
RUN pip install --no-deps -e .

# Non-root user. Code stays root-owned (read-only to the services); only models/ is the user's,
# so a stale built-in model can still be rebuilt in place at first start.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin baton \
    && mkdir -p /app/models /results \
    && chown baton:baton /app/models /results
USER baton

# The built-in tiny model is generated locally from a fixed seed (nothing is downloaded), so it
# is built here, once: every container of the stack (tokenizer, prefill, N decode replicas,
# detokenizer) then starts with the same bytes instead of each building its own copy at start.
# A real model is never baked in: mount it and point BATON_MODEL at it.
RUN python -m shared.models.tiny --preset tiny --arch llama --out /app/models/tiny

# Never reach a model hub at run time; BATON_MODEL must be a local directory.
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
