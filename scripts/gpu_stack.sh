#!/usr/bin/env bash
# Runs the whole Bulkhead stack on the GPU machine, from a copy of this repository there.
#
#   scripts/gpu_stack.sh smoke OUT_DIR              imports, a KV round trip, a tiny deployment
#   scripts/gpu_stack.sh split OUT_DIR [ARGS...]    bulkhead bench split OUT_DIR ARGS
#   scripts/gpu_stack.sh env -- COMMAND...          any command with the stack's environment
#
# BULKHEAD_WHEELS (default ../.whl_lm, else ./.whl_lm) is the folder scripts/device_wheels.sh
# made: wheels are installed (no index, no deps) into /tmp/site, and redis-server runs from the
# folder's unpacked Debian packages through a wrapper, so only it sees their libraries.
# docs/gpu_stack.md ("Air-gapped hosts") tells when to use it.
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=${BULKHEAD_WHEELS:-}
if [ -z "$WHL" ]; then
  if [ -d ../.whl_lm ]; then WHL=../.whl_lm; else WHL=.whl_lm; fi
fi
WHL=$(cd "$WHL" && pwd)
if [ ! -f /tmp/site/.bulkhead_wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl
  touch /tmp/site/.bulkhead_wheels
fi
mkdir -p /tmp/bulkhead-bin
cat > /tmp/bulkhead-bin/redis-server <<WRAP
#!/bin/sh
LD_LIBRARY_PATH=$WHL/redis/usr/lib/x86_64-linux-gnu exec $WHL/redis/usr/bin/redis-server "\$@"
WRAP
chmod +x /tmp/bulkhead-bin/redis-server
export PATH=/tmp/bulkhead-bin:$PATH
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=${1:?smoke, split or env}
shift
case "$what" in
  smoke) exec python3 -m lab.bench.gpu_smoke "$@" ;;
  split) exec python3 -m launch.cli bench split "$@" ;;
  env) [ "${1:-}" = "--" ] && shift; exec "$@" ;;
  *) echo "gpu_stack.sh: unknown step $what (smoke, split, env)" >&2; exit 2 ;;
esac
