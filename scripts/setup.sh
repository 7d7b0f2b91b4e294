#!/usr/bin/env bash
# Set up everything Lakestream's demo, tests and benchmarks need on a fresh Debian machine:
# system packages (FUSE 3), a virtual environment in .venv, the project with all extras, and the
# Azure Blob Storage emulator the az:// tests start (Azurite, from the npm registry, in .venv/azurite).
# Each stage says what it does on stderr; a stage with nothing to do says so and moves on.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
say() { echo "setup: $*" >&2; }

if dpkg -s fuse3 libfuse3-dev pkg-config nats-server >/dev/null 2>&1; then
  say "system packages fuse3, libfuse3-dev, pkg-config, nats-server: already installed"
else
  say "installing system packages fuse3, libfuse3-dev, pkg-config, nats-server (apt-get)..."
  apt-get update -qq
  apt-get install -y -qq fuse3 libfuse3-dev pkg-config nats-server >/dev/null
fi
if [ -x .venv/bin/python ]; then
  say "virtual environment .venv: exists"
else
  say "creating the virtual environment .venv..."
  python3 -m venv .venv
fi
say "upgrading pip in .venv..."
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
say "installing torch 2.13.0 (a few minutes on a fresh machine; quiet unless it fails)..."
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
say "installing lakestream with its extras s3, mount, torch, sources, hf, ray, examples, metrics, bench, dev (a few minutes on a fresh machine)..."
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[s3,mount,torch,sources,hf,ray,examples,metrics,bench,dev]"
AZURITE=3.35.0
if [ -x .venv/azurite/node_modules/.bin/azurite-blob ] && grep -q "\"version\": \"$AZURITE\"" .venv/azurite/node_modules/azurite/package.json; then
  say "Azurite $AZURITE in .venv/azurite: already installed"
else
  if ! command -v npm >/dev/null 2>&1; then
    say "installing Node.js and npm (apt-get), for Azurite..."
    apt-get update -qq
    apt-get install -y -qq nodejs npm >/dev/null
  fi
  say "installing Azurite $AZURITE into .venv/azurite (npm; the az:// tests' emulator)..."
  npm install --silent --no-audit --no-fund --prefix .venv/azurite "azurite@$AZURITE" >/dev/null
fi
say "done: $(.venv/bin/lakestream --version) in .venv (try: .venv/bin/lakestream demo)"
