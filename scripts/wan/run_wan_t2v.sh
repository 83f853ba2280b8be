#!/usr/bin/env bash
# Wan2.1 text-to-video through the runnerkit launch script, with warmup.
#   scripts/wan/run_wan_t2v.sh [CONFIG_JSON] [runnerkit flags...]
#   scripts/wan/run_wan_t2v.sh [CONFIG_JSON] --requests requests.jsonl [runnerkit flags...]
# CONFIG_JSON defaults to the tiny debug config (synthetic weights, CPU-friendly); for real
# checkpoints use configs/wan/wan_t2v_1.3b.json or wan_t2v_14b.json with --model_path.
# Without --requests, one request runs with $PROMPT (a default prompt; --prompt replaces it) saved
# to $OUT (default outputs/wan_t2v.mp4; --save_result_path or --save_tensor_path replace it); with
# --requests, each line of the file is a request.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
config="$here/configs/wan/wan_t2v_tiny.json"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config="$1"; shift; fi  # first argument, unless it is a flag
prompt=(--prompt "${PROMPT:-a red fox running through fresh snow, cinematic lighting}")
out=(--save_result_path "${OUT:-$here/outputs/wan_t2v.mp4}")
for arg in "$@"; do
  case "$arg" in
    --requests|--requests=*) prompt=(); out=() ;;  # the requests file says what to run and where
    --prompt|--prompt=*) prompt=() ;;
    --save_result_path|--save_result_path=*|--save_tensor_path|--save_tensor_path=*) out=() ;;
  esac
done
exec python -m runnerkit.infer --config_json "$config" --warmup "${prompt[@]}" "${out[@]}" "$@"
