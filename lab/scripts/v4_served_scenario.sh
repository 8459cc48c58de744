#!/usr/bin/env bash
# The mission's scenario as served processes, on one H200 (or a 96 GB card): DeepSeek-V4-Flash's
# shape (43 layers x 128 routed experts, FP8 projections + MXFP4 experts, FP8 KV) with dummy
# weights, started by `bulkhead up` the way an operator starts it, driven by `bulkhead bench`.
#
#   lab/scripts/v4_served_scenario.sh OUT_DIR [split] [serve]        (default: split serve)
#
# split: `bulkhead bench split --up`: arm "split" (prefill + decode workers on one card sharing
#        one copy of the weights, KV through LMCache into Redis) against arm "colocated" (one
#        worker does both), each under 16 streaming agent chats (tools, tool_choice auto) while
#        131,072- and 262,144-token prompts arrive. OUT_DIR/split/split.json + .png + logs/.
# serve: one `bulkhead up --share-weights` and `bulkhead bench` shaped like `vllm bench serve
#        --random-input-len 8192 --random-output-len 1024 --max-concurrency 32`.
#        OUT_DIR/serve.json + .log.
# Settings every worker reads are in OUT_DIR/settings.yaml (written here; see deploy/README.md).
# Runs under scripts/gpu_stack.sh (BULKHEAD_WHEELS as there) when the stack is not installed.
set -uo pipefail
out=${1:?usage: lab/scripts/v4_served_scenario.sh OUT_DIR [split] [serve]}
out=$(realpath -m "$out")
shift
cd "$(dirname "$0")/../.."
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(split serve)
mkdir -p "$out"
run() { if [ -n "${BULKHEAD_WHEELS:-}" ]; then scripts/gpu_stack.sh env -- "$@"; else "$@"; fi; }
# Full depth (43 layers) on a card of 96 GB or more; 21 fits an 80 GB card (the H100) beside
# both roles' plans. V4_LAYERS overrides.
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
if [ "${mem_mib:-0}" -ge 90000 ]; then layers=${V4_LAYERS:-43}; else layers=${V4_LAYERS:-21}; fi
model=${V4_MODEL_DIR:-/tmp/bulkhead-v4-flash-config-${layers}l}
rc=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ ! -f "$model/config.json" ]; then
  run python3 -m lab.bench.deepseek_v4.write_checkpoint "$model" --layers "$layers" --experts 128 \
    --config-only || exit 1
fi
# One settings file for every process, as an operator would write it. The decode worker holds
# 20 sequences (16 chats + 2 long prompts in flight + room) within a KV extent of
# 2,200 blocks x 256 tokens (563k tokens: the chats' few thousand and two long prompts);
# the prefill worker two long prompts at a time. Chats carry tools: the router renders them
# with a tool template and parses hermes-style calls. Prompts from 4,096 uncached tokens go to
# the prefill worker (the chats' ~550 stay on the decode worker; with the default of 256 they
# queue behind a long prompt in the prefill worker).
cat > "$out/settings.yaml" <<YAML
worker:
  load_format: dummy
  kv_cache_dtype: fp8
  max_context: "266240"
  chunk_tokens: 8192
  kv_staging_gb: 6
  kv_visible_timeout_s: 120
prefill:
  max_batch: 2
  num_blocks: 2200
decode:
  max_batch: 20
  num_blocks: 2200
router:
  split_threshold_tokens: 4096
YAML
agent=()
if [ "${TOOLS:-1}" = 1 ]; then  # TOOLS=0: plain chats (a router without a tool template)
  agent=(--agent-tools)
  cat >> "$out/settings.yaml" <<YAML
  chat_template: $PWD/deploy/chat_templates/chatml_tools.jinja
  tool_call_parser: hermes
YAML
fi
for part in "${parts[@]}"; do
  echo "== $(date -u +%T) $part"
  case $part in
    split)
      run timeout "${SPLIT_S:-470}" python3 -m launch.cli bench split "$out/split" --up --model "$model" \
        --config "$out/settings.yaml" --device cuda --long-tokens 131072,262144 --chats 16 \
        --arms "${ARMS:-split,colocated}" \
        "${agent[@]}" --chat-prompt-chars 400 --output-tokens 256 --long-output-tokens 8 \
        --duration-s "${DURATION_S:-50}" --first-long-s 5 --long-every-s "${LONG_EVERY_S:-20}" \
        > "$out/split.log" 2>&1 || rc=1
      grep -E "^\[(split|colocated)\] (ITL|long|chats|prefill|decode|colocated|started)" \
        "$out/split.log" | tail -n 24 ;;
    serve)
      # vLLM's benchmark keeps 32 requests of 8,192 + 1,024 tokens in flight: every worker
      # holds 32 sequences of up to 9,472 tokens here (prompts go through the prefill worker)
      sed -e 's/max_context: "266240"/max_context: "9472"/' -e 's/max_batch: [0-9]*/max_batch: 32/' \
        -e '/num_blocks/d' "$out/settings.yaml" > "$out/serve.yaml"
      port=18000
      run timeout "${SERVE_S:-420}" bash -c "
        python3 -m launch.cli up --model '$model' --config '$out/serve.yaml' --share-weights \
          --port $port --log-dir '$out/serve-logs' > '$out/serve-up.log' 2>&1 &
        up=\$!
        for _ in \$(seq 240); do
          curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1
        done
        python3 -m launch.cli bench --base-url http://127.0.0.1:$port --endpoint completions \
          --concurrency 32 --num-requests 32 --prompt-tokens 8192 --output-tokens 1024 \
          --timeout-s 300 --out-json '$out/serve.json' --out-png '' > '$out/serve.log' 2>&1
        code=\$?
        kill -INT \$up; wait \$up
        exit \$code" || rc=1
      tail -n 20 "$out/serve.log" ;;
    *) echo "unknown part: $part (split, serve)" >&2; rc=2 ;;
  esac
done
exit $rc
