#!/usr/bin/env bash
# The side lane's first GPU call (docs/memory.md, "The fused decode's side lane"): its GPU tests,
# then batch-1 and batch-8 decode with the lane on and off, alternated so that drift in the
# card's clocks shows as a spread rather than a gain. 21 layers (V4-Flash's first 21) x 128
# experts, FP8 + MXFP4 weights built on the device: fits an H100 as well as an H200.
#
#   lab/scripts/v4_side_lane_check.sh OUT_DIR
#
# Writes OUT_DIR/tests.log and OUT_DIR/lanes.json + .log; runs under scripts/gpu_stack.sh
# (BULKHEAD_WHEELS as there). The parts' time limits add up to 560 s, inside one device call's
# 600. LAYERS, STEPS, BATCHES override the shape (LAYERS=SSCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHC
# on an H200 for full depth). SEPARATE=1: one engine build per pass instead (lanes<N>_<i>.*),
# should the one-build recapture fail.
set -uo pipefail
out=${1:?usage: lab/scripts/v4_side_lane_check.sh OUT_DIR}
out=$(realpath -m "$out")
cd "$(dirname "$0")/../.."
mkdir -p "$out"
layers=${LAYERS:-SSCHCHCHCHCHCHCHCHCHC}
steps=${STEPS:-64}
batches=${BATCHES:-1,8}
run() { scripts/gpu_stack.sh env -- "$@"; }
rc=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== $(date -u +%T) GPU tests"
run timeout 180 python3 -m pytest -q -m gpu -o addopts="" tests/engine/test_side_lane.py \
  tests/engine/deepseek_v4/test_deepseek_v4_lanes.py > "$out/tests.log" 2>&1 || rc=1
tail -n 12 "$out/tests.log"
decode() {  # decode() NAME LANES: one engine build, a pass of every row per entry of LANES
  echo "== $(date -u +%T) $1 (lanes $2)"
  run timeout "$3" python3 -m lab.bench.deepseek_v4.decode run --weights fp8-mxfp4 --layers "$layers" \
    --experts 128 --steps "$steps" --decode fused --batches "$batches" --prompts 1024 \
    --lanes "$2" --deadline $(($3 - 30)) --out "$out/$1.json" > "$out/$1.log" 2>&1
  local code=$?
  grep -E "\[decode\] (lanes|B=)|allocation|Error" "$out/$1.log" | tail -n 12
  return $code
}
if [ "${SEPARATE:-0}" = 1 ]; then
  i=0
  for lanes in 2 1 2 1; do
    i=$((i + 1))
    decode "lanes${lanes}_$i" "$lanes" 95 || rc=1
  done
else
  # one build, the graphs captured again between passes (lab/bench/deepseek_v4/decode.py --lanes)
  decode lanes 2,1,2,1 380 || rc=1
fi
exit $rc
