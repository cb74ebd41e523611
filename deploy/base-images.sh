#!/usr/bin/env bash
# Local base images, for a machine that cannot reach Docker Hub (docs/deploy.md, "Without a
# registry"). Everything comes from Debian's packages:
#
#   baton-debian:bookworm          debootstrap --variant=minbase bookworm, `docker import`ed
#   baton-python:3.11-bookworm     + Debian's python3 (3.11), venv, gcc: the Dockerfile's BASE_IMAGE
#   baton-rabbitmq:bookworm        + Debian's rabbitmq-server, management plugin on
#
#   deploy/base-images.sh [--wheels DIR] [--ca-bundle FILE] [--model FILE] [--force] [--no-images] >> .env
#
# stdout: the variables that make Compose use these images (BATON_BASE_IMAGE,
# BATON_RABBITMQ_IMAGE), for .env or the shell; progress goes to stderr. An image that exists is
# kept unless --force. What the Baton image build then takes from this machine goes into
# deploy/local/ (its README):
#   --wheels DIR      DIR's torch wheels; the one for Python 3.11 is named in BATON_TORCH_WHEEL,
#                     and the image installs torch from it (no PyTorch index needed);
#   --ca-bundle FILE  the CA bundle pip trusts in the build, where HTTPS goes through a
#                     TLS-inspecting proxy (e.g. this machine's /etc/ssl/certs/ca-certificates.crt);
#   --model FILE      the default model's GGUF file (this machine's cached copy), baked into the
#                     image instead of fetched with pip during the build.
# --no-images: only those, for a machine that reaches Docker Hub.
# Env: DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SECURITY_MIRROR.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_IMAGE=baton-debian:bookworm
PYTHON_IMAGE=baton-python:3.11-bookworm
RABBITMQ_IMAGE=baton-rabbitmq:bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
force=0 images=1 wheels="" ca_bundle="" model="" torch_wheel=""
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1 ;;
    --no-images) images=0 ;;
    --wheels) wheels="${2:?--wheels needs a directory}"; shift ;;
    --ca-bundle) ca_bundle="${2:?--ca-bundle needs a file}"; shift ;;
    --model) model="${2:?--model needs a file}"; shift ;;
    -h|--help) sed -n '2,/^set -/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done
say() { echo "base-images: $*" >&2; }
have() { [ "$force" = 0 ] && docker image inspect "$1" >/dev/null 2>&1; }

if [ -n "$wheels" ]; then
  found=("$wheels"/torch-*.whl)
  [ -e "${found[0]}" ] || { echo "no torch-*.whl in $wheels" >&2; exit 1; }
  # Hard links where the directory is on the same file system (no copy of ~200 MB).
  for w in "${found[@]}"; do ln -f "$w" deploy/local/ 2>/dev/null || cp -f "$w" deploy/local/; done
  torch_wheel="$(cd deploy/local && ls torch-*-cp311-*.whl 2>/dev/null | sort -V | tail -n1)"
  [ -n "$torch_wheel" ] || { echo "no torch wheel for Python 3.11 (cp311) in $wheels" >&2; exit 1; }
  say "torch from deploy/local/$torch_wheel"
fi
if [ -n "$model" ]; then
  [ -f "$model" ] || { echo "no model file $model" >&2; exit 1; }
  ln -f "$model" deploy/local/ 2>/dev/null || cp -f "$model" deploy/local/
  say "the image takes its default model from $model"
fi
if [ -n "$ca_bundle" ]; then
  cp -f "$ca_bundle" deploy/local/ca-certificates.crt
  say "pip in the image build trusts $ca_bundle"
fi

if [ "$images" = 0 ]; then
  if [ -n "$torch_wheel" ]; then echo "BATON_TORCH_WHEEL=$torch_wheel"; fi
  exit 0
fi

if ! have "$DEBIAN_IMAGE"; then
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    apt-get install -y -q debootstrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
  fi
  root="$(mktemp -d -t baton-rootfs-XXXX)"
  trap 'rm -rf "$root"' EXIT
  say "debootstrap bookworm into $root (about a minute)"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >&2
  cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
SOURCES
  # As Debian's own images: no package cache kept in layers, no recommends.
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
APT::Install-Recommends "false";
APT
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  # An imported image has no environment: PATH must be set, or `ENV PATH=...:$PATH` breaks.
  tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
  say "built $DEBIAN_IMAGE"
fi

for pair in "$PYTHON_IMAGE:python" "$RABBITMQ_IMAGE:rabbitmq"; do
  image="${pair%:*}" file="deploy/images/${pair##*:}.Dockerfile"
  if ! have "$image"; then
    say "building $image ($file)"
    docker build -q --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$image" -f "$file" deploy/images >&2
  fi
done

echo "BATON_BASE_IMAGE=$PYTHON_IMAGE"
echo "BATON_RABBITMQ_IMAGE=$RABBITMQ_IMAGE"
if [ -n "$torch_wheel" ]; then echo "BATON_TORCH_WHEEL=$torch_wheel"; fi
