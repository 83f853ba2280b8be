#!/usr/bin/env bash
# Wan image-to-video (wan2.1 i2v, flf2v, Wan2.2 MoE i2v) through the runnerkit launch script, with warmup.
#   scripts/wan/run_wan_i2v.sh [CONFIG_JSON] [runnerkit flags...]
#   scripts/wan/run_wan_i2v.sh [CONFIG_JSON] --requests requests.jsonl [runnerkit flags...]
# CONFIG_JSON defaults to the tiny i2v config (synthetic weights, CPU-friendly); for real checkpoints
# use configs/wan/wan_i2v_14b.json, wan_flf2v_14b.json or wan22_moe_i2v_a14b.json with --model_path.
# Without --image_path, the example image $IMAGE (default assets/examples/first_frame.png) is the
# first frame; a flf2v config also gets $LAST_IMAGE (default assets/examples/last_frame.png) unless
# --last_frame_path is given. $PROMPT and $OUT (default outputs/wan_i2v.mp4) as in run_wan_t2v.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
config="$here/configs/wan/wan_i2v_tiny.json"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config="$1"; shift; fi  # first argument, unless it is a flag
images=(--image_path "${IMAGE:-$here/assets/examples/first_frame.png}")
last=()
if grep -qs '"task": *"flf2v"' "$config"; then last=(--last_frame_path "${LAST_IMAGE:-$here/assets/examples/last_frame.png}"); fi
for arg in "$@"; do
  case "$arg" in
    --requests|--requests=*) images=(); last=() ;;  # the requests file names its images
    --image_path|--image_path=*) images=() ;;
    --last_frame_path|--last_frame_path=*) last=() ;;
  esac
done
OUT="${OUT:-$here/outputs/wan_i2v.mp4}" exec "$here/scripts/wan/run_wan_t2v.sh" "$config" "${images[@]}" "${last[@]}" "$@"
