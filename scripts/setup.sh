#!/usr/bin/env bash
# Set up everything Lakestream's demo, tests and benchmarks need on a fresh Debian machine:
# system packages (FUSE 3), a virtual environment in .venv, and the project with all extras.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
if ! dpkg -s fuse3 libfuse3-dev pkg-config >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq fuse3 libfuse3-dev pkg-config >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[s3,mount,torch,dev]"
