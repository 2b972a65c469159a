#!/usr/bin/env bash
# Creates .venv and installs the project with its test extras.
# On a machine without an NVIDIA GPU it installs the CPU build of torch first (a CUDA
# build is several GB). Where the CPU wheel is not on a configured index or find-links
# folder, point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "installing torch (CUDA build)"
    pip install "torch>=2.5"
  else
    echo "installing torch ${TORCH_VERSION} (CPU build)"
    pip install "torch==${TORCH_VERSION}+cpu" || {
      echo "error: no CPU build of torch ${TORCH_VERSION} found; set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index" >&2
      exit 1
    }
  fi
fi
pip install -e ".[test]"
