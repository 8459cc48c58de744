#!/usr/bin/env bash
# Rebuilds the folder of wheels (and a redis-server binary) that the GPU machine lacks, so the
# whole stack (router, workers, LMCache, Redis) can run there: see docs/gpu_stack.md.
#
# Usage: scripts/device_wheels.sh [DEST]     (DEST defaults to ./.whl_lm; keep it git-ignored)
# Needs pip with network access here; the device has none. Everything is x86-64, CPython 3.12.
# Only packages the device image lacks (or has at a version our generated stubs refuse) are
# fetched, each pinned to what constraints.txt names, and nothing else: --no-deps everywhere.
set -euo pipefail
DEST=${1:-.whl_lm}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

# The runtime closure of router + workers + LMCache's cache engine on the device image, found by
# tracing sys.modules through a KVStore round trip and the service imports (lab/results/notebook.md).
WHEELS=(
  lmcache==0.5.6 redis==8.1.0
  fastapi==0.141.1 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4
  annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0
  uvicorn==0.55.0 httptools==0.9.0
  grpcio==1.78.0 grpcio-health-checking==1.78.0 protobuf==6.33.6
  aiofile==3.12.3 caio==0.12.10 cachetools==8.0.2 nvtx==0.2.17 msgspec==0.23.0 pyzmq==27.3.0
  opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0 opentelemetry-semantic-conventions==0.61b0
  importlib-metadata==8.7.1 cufile-python==0.2.0 blake3==1.0.11
  cryptography==48.0.0 cffi==2.0.0 pycparser==3.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2  # constrained decoding (lab.bench.grammar, workers)
)
PLATFORMS=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

# redis-server from Debian packages, unpacked (never installed): the binary and the libraries a
# bare image may lack. LD_LIBRARY_PATH=$DEST/redis/usr/lib/x86_64-linux-gnu runs it there.
TMP=$(mktemp -d)
(cd "$TMP" && apt-get download -q redis-server redis-tools liblzf1 libjemalloc2 libatomic1 \
   >/dev/null)
rm -rf "$DEST/redis"
for deb in "$TMP"/*.deb; do dpkg -x "$deb" "$DEST/redis"; done
rm -rf "$TMP" "$DEST/redis/usr/share" "$DEST/redis/etc" "$DEST/redis/lib"
# redis-server is a link to redis-check-rdb (one binary, named by argv[0]); keep a real file.
if [ -L "$DEST/redis/usr/bin/redis-server" ]; then
  cp --remove-destination "$(readlink -f "$DEST/redis/usr/bin/redis-server")" \
    "$DEST/redis/usr/bin/redis-server"
fi
find "$DEST/redis/usr/bin" -type f ! -name redis-server ! -name redis-cli -delete
find "$DEST/redis/usr/bin" -type l -delete
du -sh "$DEST"
