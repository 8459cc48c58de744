#!/usr/bin/env bash
# Issue 20's full-depth rows in one GPU call (plans ~84 GiB of GPU memory: an H200, or a 96 GB
# card): DeepSeek-V4-Flash shape, 43 layers x 128 experts, FP8/MXFP4 weights built on the device.
#
#   lab/scripts/v4_full_depth.sh OUT_DIR [decode] [decode-long] [prompt] [incident]
#                                                                    (default: decode prompt)
#
# decode:   CUDA-graph decode at batch 1, 8, 32 against the weight-streaming limit
# decode-long: the same at batch 1 after a 131,072-token prompt (the indexer's top-k over
#           32,768 compressed entries a CSA layer and step)
# prompt:   a 131,072-token prompt in 8192-token chunks (tok/s, peak / plan, allocations)
# incident: chunked prefill toward 1,048,576 tokens in 4096-token chunks with 4 decodes running
#           (and its first steps again on the previous kernels, for the ratio)
# Each part writes OUT_DIR/<part>.json and .log; runs under scripts/gpu_stack.sh (BULKHEAD_WHEELS
# as there). Extra arguments for the decode bench: V4_DECODE_ARGS (e.g. "--pdl trigger").
set -uo pipefail
out=${1:?usage: lab/scripts/v4_full_depth.sh OUT_DIR [decode] [decode-long] [prompt] [incident]}
out=$(realpath -m "$out")  # the caller's folder, before the cd
shift
cd "$(dirname "$0")/../.."
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(decode prompt)
for part in "${parts[@]}"; do  # all checked before anything runs
  case $part in
    decode|decode-long|prompt|incident) ;;
    *) echo "unknown part: $part (decode, decode-long, prompt, incident)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
layers=SSCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHC
run() { scripts/gpu_stack.sh env -- "$@"; }
rc=0
for part in "${parts[@]}"; do
  echo "== $(date -u +%T) $part"
  case $part in
    decode)
      # shellcheck disable=SC2086  (V4_DECODE_ARGS is a list of flags)
      run python3 -m lab.bench.deepseek_v4.decode run --weights fp8-mxfp4 --layers $layers \
        --experts 128 --batches 1,8,32 --prompts 1024 --steps 16 --decode fused \
        ${V4_DECODE_ARGS:-} --out "$out/decode.json" > "$out/decode.log" 2>&1 || rc=1
      tail -n 8 "$out/decode.log" ;;
    decode-long)
      # shellcheck disable=SC2086
      run python3 -m lab.bench.deepseek_v4.decode run --weights fp8-mxfp4 --layers $layers \
        --experts 128 --batches 1 --prompts 131072 --context 135168 --steps 16 --decode fused \
        ${V4_DECODE_ARGS:-} --out "$out/decode-long.json" > "$out/decode-long.log" 2>&1 || rc=1
      tail -n 6 "$out/decode-long.log" ;;
    prompt)
      run python3 -m lab.bench.deepseek_v4.incident run --prompt 131072 --chunk 8192 \
        --previous-steps 0 --decodes 4 --block-size 256 --deadline 45 --print-every 8 \
        --out "$out/prompt.json" > "$out/prompt.log" 2>&1 || rc=1
      grep "prompt\]" "$out/prompt.log" | tail -n 4 ;;
    incident)
      run python3 -m lab.bench.deepseek_v4.incident run --prompt 0 --chunk 4096 \
        --decodes 4 --block-size 256 \
        --deadline 300 --print-every 16 --out "$out/incident.json" > "$out/incident.log" 2>&1 || rc=1
      tail -n 4 "$out/incident.log" ;;
  esac
done
exit $rc
