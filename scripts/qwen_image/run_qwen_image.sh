#!/usr/bin/env bash
# Qwen-Image text-to-image (t2i) and image editing (i2i) through the runnerkit launch script, with warmup.
#   scripts/qwen_image/run_qwen_image.sh [CONFIG_JSON] [runnerkit flags...]
#   scripts/qwen_image/run_qwen_image.sh [CONFIG_JSON] --requests requests.jsonl [runnerkit flags...]
# CONFIG_JSON defaults to the tiny text-to-image config (synthetic weights, CPU-friendly); for real
# checkpoints use configs/qwen_image/qwen_image_t2i_20b.json or qwen_image_edit_plus_20b.json with
# --model_path. An i2i config without --image_path edits $IMAGE (default
# assets/examples/first_frame.png); further references: --extra_image_paths B.png [C.png].
# $PROMPT (a default prompt; --prompt replaces it) and $OUT (default outputs/qwen_image.png;
# --save_result_path or --save_tensor_path replace it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
config="$here/configs/qwen_image/qwen_image_t2i_tiny.json"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config="$1"; shift; fi  # first argument, unless it is a flag
prompt=(--prompt "${PROMPT:-a red fox in fresh snow, a sign that reads \"runnerkit\"}")
out=(--save_result_path "${OUT:-$here/outputs/qwen_image.png}")
images=()
if grep -qs '"task": *"i2i"' "$config"; then images=(--image_path "${IMAGE:-$here/assets/examples/first_frame.png}"); fi
for arg in "$@"; do
  case "$arg" in
    --requests|--requests=*) prompt=(); out=(); images=() ;;  # the requests file says what to run and where
    --prompt|--prompt=*) prompt=() ;;
    --image_path|--image_path=*) images=() ;;
    --save_result_path|--save_result_path=*|--save_tensor_path|--save_tensor_path=*) out=() ;;
  esac
done
exec python -m runnerkit.infer --config_json "$config" --warmup "${prompt[@]}" "${images[@]}" "${out[@]}" "$@"
