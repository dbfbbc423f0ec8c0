#!/bin/bash
# One call on the lent GPU machine: compiled-kernel tests, the GPU parity test and the
# decode/prefill benchmark, each under its own time limit, logs and tables under $OUT.
#   bash benchmarks/gpu_run.sh [kernels] [parity] [bench]     (default: all three)
set -u
OUT=${OUT:-/tmp/moeferry-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MOEFERRY_REPORT_DIR="$OUT" TOKENIZERS_PARALLELISM=false
parts=${*:-kernels parity bench}
quiet='falling back to its reference|deprecated|output = func|FutureWarning'
{ nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
for part in $parts; do
  start=$(date +%s)
  case $part in
    kernels) timeout ${KERNELS_S:-150} python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rf \
               -k "${KERNELS_K:-real_shapes or conv or decode or store_kv}" 2>&1 \
               | grep -Ev "$quiet" > "$OUT/kernels.log" ;;
    parity)  timeout ${PARITY_S:-170} python3 -m pytest tests/test_gpu_parity.py -m gpu -q -s -p no:cacheprovider -rf 2>&1 \
               | grep -Ev "$quiet" > "$OUT/parity.log" ;;
    bench)   timeout ${BENCH_S:-270} python3 benchmarks/decode_prefill.py --out "$OUT" --steps ${STEPS:-12} 2>&1 | grep -Ev "$quiet" > "$OUT/bench.log" ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
  tail -n 25 "$OUT/$part.log"
done
