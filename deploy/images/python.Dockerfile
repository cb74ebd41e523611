# A Python 3.11 base from Debian's packages (deploy/base-images.sh), in place of python:3.11-slim
# where Docker Hub cannot be reached. Baton's Dockerfile makes its own virtualenv on top, so this
# needs no pip of its own: the interpreter, venv (ensurepip) and a C compiler (Triton's launcher,
# Baton's CPU kernels) are all.
ARG DEBIAN_IMAGE=baton-debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev passwd \
       ca-certificates \
    && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
