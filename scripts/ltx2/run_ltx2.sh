#!/usr/bin/env bash
# LTX-2.3 (22B, distilled) text-to-video+audio (t2av) and first-frame-to-video+audio (i2av) through the
# runnerkit launch script, with warmup.
#   scripts/ltx2/run_ltx2.sh [runnerkit flags...]
#   TASK=i2av IMAGE=first.png scripts/ltx2/run_ltx2.sh [runnerkit flags...]
#   scripts/ltx2/run_ltx2.sh --requests requests.jsonl [runnerkit flags...]
#   TINY=1 scripts/ltx2/run_ltx2.sh       # the tiny config, synthetic weights, on the CPU: nothing to download
# Environment:
#   TASK           t2av (default) or i2av
#   LTX_MODEL      the release's single file (default models/LTX-2.3/ltx-2.3-22b-distilled.safetensors)
#   LTX_UPSAMPLER  its x2 upsampler file (default: ltx-2.3-spatial-upscaler-x2-1.0.safetensors next to LTX_MODEL)
#   GEMMA_PATH     the gemma-3-12b-it folder (default models/gemma-3-12b-it)
#   CONFIG         another config JSON (default configs/ltx2/ltx23_${TASK}_22b_distilled.json; with TINY=1
#                  configs/ltx2/ltx2_${TASK}_tiny.json). A diffusers folder as LTX_MODEL holds its own
#                  upsampler and Gemma: give it a CONFIG without `upsampler_path` and `text_encoder_path`.
#   PROMPT         the prompt (--prompt replaces it); IMAGE: i2av's first frame (default
#                  assets/examples/first_frame.png; --image_path replaces it)
#   OUT            the result (default outputs/ltx2_${TASK}.mp4: H.264 video with its AAC audio stream;
#                  --save_result_path or --save_tensor_path replace it)
# Without --requests one request runs; with it, each line of the file is a request.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
task="${TASK:-t2av}"
case "$task" in
  t2av|i2av) ;;
  *) echo "run_ltx2.sh: TASK must be t2av or i2av (got '$task')" >&2; exit 2 ;;
esac
if [ -n "${TINY:-}" ]; then
  config="${CONFIG:-$here/configs/ltx2/ltx2_${task}_tiny.json}"
  where=(--device cpu)
else
  config="${CONFIG:-$here/configs/ltx2/ltx23_${task}_22b_distilled.json}"
  model="${LTX_MODEL:-$here/models/LTX-2.3/ltx-2.3-22b-distilled.safetensors}"
  where=(--model_path "$model")
  if [ "${model%.safetensors}" != "$model" ]; then  # the single file: upsampler and Gemma ship separately
    where+=(--upsampler_path "${LTX_UPSAMPLER:-$(dirname "$model")/ltx-2.3-spatial-upscaler-x2-1.0.safetensors}"
            --text_encoder_path "${GEMMA_PATH:-$here/models/gemma-3-12b-it}")
  fi
fi
prompt=(--prompt "${PROMPT:-a red fox runs through fresh snow at dawn, wind howling through the pines}")
out=(--save_result_path "${OUT:-$here/outputs/ltx2_${task}.mp4}")
images=()
if [ "$task" = i2av ]; then images=(--image_path "${IMAGE:-$here/assets/examples/first_frame.png}"); fi
for arg in "$@"; do
  case "$arg" in
    --requests|--requests=*) prompt=(); out=(); images=() ;;  # the requests file says what to run and where
    --prompt|--prompt=*) prompt=() ;;
    --image_path|--image_path=*) images=() ;;
    --save_result_path|--save_result_path=*|--save_tensor_path|--save_tensor_path=*) out=() ;;
  esac
done
exec python -m runnerkit.infer --config_json "$config" --task "$task" "${where[@]}" --warmup "${prompt[@]}" \
  "${images[@]}" "${out[@]}" "$@"
