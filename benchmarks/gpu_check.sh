#!/bin/bash
# One call on the lent GPU machine after an engine change: GPU tests (offload vs resident on
# every MoE format, parity with transformers, resident backend) and the engine-level offload
# benchmark on a 4-layer real-geometry checkpoint. Logs and tables under $OUT.
#   bash benchmarks/gpu_check.sh [tests] [bench]
set -u
OUT=${OUT:-/tmp/moeferry-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MOEFERRY_REPORT_DIR="$OUT" TOKENIZERS_PARALLELISM=false MOEFERRY_QUANT_DEVICE=cuda
parts=${*:-tests bench}
quiet='falling back to its reference|deprecated|output = func|FutureWarning'
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
for part in $parts; do
  start=$(date +%s)
  case $part in
    tests) timeout ${TESTS_S:-240} python3 -m pytest tests/test_offload_gpu.py tests/test_gpu_parity.py \
             "tests/test_moe_kernels.py::test_gpu_resident_backend" -m gpu -q -x -p no:cacheprovider -rf 2>&1 \
             | grep -Ev "$quiet" > "$OUT/tests.log" ;;
    bench) timeout ${BENCH_S:-240} bash -c "python3 -m moeferry.cli make-model --arch qwen3_5_moe --size qwen3.6-35b-a3b \
             --num-layers ${LAYERS:-4} --quant ${QUANT:-mixed_nvfp4} --router-skew 1.0 --out /tmp/q36 > /dev/null \
             && python3 benchmarks/offload_engine.py --model /tmp/q36 --out $OUT ${BENCH_ARGS:-}" 2>&1 \
             | grep -Ev "$quiet" > "$OUT/bench.log" ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
  tail -n 30 "$OUT/$part.log"
done
