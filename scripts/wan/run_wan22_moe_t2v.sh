#!/usr/bin/env bash
# Wan2.2 MoE (A14B) text-to-video through the runnerkit launch script, with warmup.
#   scripts/wan/run_wan22_moe_t2v.sh [CONFIG_JSON] [runnerkit flags...]
#   scripts/wan/run_wan22_moe_t2v.sh [CONFIG_JSON] --requests requests.jsonl [runnerkit flags...]
# CONFIG_JSON defaults to the tiny debug config (synthetic weights, CPU-friendly); for real
# checkpoints use configs/wan/wan22_moe_t2v_a14b.json with --model_path. Everything else is
# run_wan_t2v.sh's ($PROMPT, $OUT — default outputs/wan22_moe_t2v.mp4 —, --requests).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
config="$here/configs/wan/wan22_moe_t2v_tiny.json"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config="$1"; shift; fi  # first argument, unless it is a flag
OUT="${OUT:-$here/outputs/wan22_moe_t2v.mp4}" exec "$here/scripts/wan/run_wan_t2v.sh" "$config" "$@"
