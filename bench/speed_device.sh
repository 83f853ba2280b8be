#!/usr/bin/env bash
# Device runs of bench/speed.py (bench/DEVICE_RUN.md §7). Usage on the GPU machine, from the repo root:
#   bash bench/speed_device.sh stash|fa4|PLAN [speed.py args...]
# stash: keep the first part of the FlashAttention-4 CuTe-DSL libraries (carried in .fa4a) in /tmp/fa4parts;
# tests: the GPU tests (pytest -m gpu); fa4: join it with the second part (.fa4b) and install flash-attn-4 and its wheels into /tmp/site;
# PLAN: run `bench/speed.py --plan PLAN` writing $OUT/speed_PLAN.{json,md} and its log.
set -uo pipefail
what=$1; shift
# CuTe DSL's packages sit one folder down; its .pth file, which adds them, is read only from site-packages
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
case $what in
  stash) mkdir -p /tmp/fa4parts && cp .fa4a/* /tmp/fa4parts/ && ls -la /tmp/fa4parts ;;
  fa4)
    [ -d /tmp/site ] && ls /tmp/fa4parts/*.aa >/dev/null || { echo "not the warm machine of the last call"; exit 3; }
    # the wheels first: pip --target --upgrade replaces nvidia_cutlass_dsl/, which the CUDA-13 libraries extend
    cp .fa4b/*.ab /tmp/fa4parts/ &&
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4b/*.whl &&
      cat /tmp/fa4parts/cu13.part.* | xz -dc -T0 | tar -x -C /tmp/site &&
      python3 -c "import flash_attn.cute; print('flash_attn.cute imported')" ;;
  # the GPU image has no fastapi, and the server's tests have no GPU case
  tests) python3 -m pytest -q -rfEs -m gpu test_cases --ignore=test_cases/serve -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15 ;;
  *) PYTHONUNBUFFERED=1 python3 bench/speed.py --plan "$what" --out "$OUT/speed_$what" "$@" 2>&1 |
       grep --line-buffered -v "Loading weights\|Writing model shards" | tee "$OUT/speed_$what.log" ;;
esac
