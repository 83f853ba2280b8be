#!/usr/bin/env bash
# Wan2.1 text-to-video through the runnerkit launch script.
#   scripts/wan/run_wan_t2v.sh [CONFIG_JSON] [extra runnerkit flags...]
# CONFIG_JSON defaults to the tiny debug config (synthetic weights, CPU-friendly); for real
# checkpoints use configs/wan/wan_t2v_1.3b.json or wan_t2v_14b.json with --model_path.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
config="$here/configs/wan/wan_t2v_tiny.json"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config="$1"; shift; fi  # first argument, unless it is a flag
prompt="${PROMPT:-a red fox running through fresh snow, cinematic lighting}"
out="${OUT:-$here/outputs/wan_t2v.mp4}"
exec python -m runnerkit.infer \
  --config_json "$config" \
  --prompt "$prompt" \
  --save_result_path "$out" \
  --warmup \
  "$@"
