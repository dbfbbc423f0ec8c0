#!/bin/bash
# One call on the lent GPU machine for issue 13: GPU tests of the quantized kernels and the
# decode graphs, the whole-model decode of a 4-layer Qwen3.6 mixed_nvfp4 checkpoint (this
# tree, and BASE's moeferry when BASE is set), the MoE split-K sweep and the dense sweep.
# Each part has its own time limit; logs go to $OUT/r and are packed into $OUT/issue13.tgz.
#   bash benchmarks/quant_gpu_run.sh [tests] [moetests] [e2e] [moe] [dense]   (default: all but moetests)
set -u
OUT=${OUT:-/tmp/moeferry-out}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
parts=${*:-tests e2e moe dense}
quiet='falling back to its reference|deprecated|output = func|FutureWarning'
CKPT=${CKPT:-/tmp/m}
{ nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"; } > "$R/gpu.txt" 2>&1
cat "$R/gpu.txt"
for part in $parts; do
  start=$(date +%s)
  case $part in
    tests) timeout ${TESTS_S:-90} python3 -m pytest tests/test_quant_linear.py tests/test_gpu_graphs.py -m gpu -q \
             -p no:cacheprovider -rf 2>&1 | grep -Ev "$quiet" > "$R/tests.log" ;;
    moetests) timeout ${MOETESTS_S:-300} python3 -m pytest tests/test_moe_kernels.py -m gpu -q -p no:cacheprovider -rf 2>&1 \
             | grep -Ev "$quiet" > "$R/moetests.log" ;;
    e2e) { [ -f "$CKPT/config.json" ] || MOEFERRY_QUANT_DEVICE=cuda timeout ${MAKE_S:-100} python3 -m moeferry.cli make-model \
             --arch qwen3_5_moe --size qwen3.6-35b-a3b --num-layers 4 --quant mixed_nvfp4 --out "$CKPT"
           du -sh "$CKPT"
           timeout ${E2E_S:-70} python3 benchmarks/quant_decode.py e2e "$CKPT" --out "$R" --tag _after ${PROFILE:---profile}
           if [ -n "${BASE:-}" ]; then
             PYTHONPATH=$BASE timeout ${E2E_S:-70} python3 benchmarks/quant_decode.py e2e "$CKPT" --out "$R" --tag _before
           fi; } > "$R/e2e.log" 2>&1 ;;
    moe) timeout ${MOE_S:-480} python3 benchmarks/quant_decode.py moe --out "$R" > /dev/null 2>"$R/moe.err" ;;
    dense) timeout ${DENSE_S:-120} python3 benchmarks/quant_decode.py dense --out "$R" > /dev/null 2>"$R/dense.err" ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
  tar czf "$OUT/issue13.tgz" -C "$OUT" r  # after every part: what ran survives a cut-off call
done
echo "==== summary"
tail -n 15 "$R/tests.log" 2>/dev/null
tail -n 15 "$R/moetests.log" 2>/dev/null
grep -E "load|moeferry from|Error|error" "$R/e2e.log" 2>/dev/null | tail -n 8
grep -E "T=|winners" "$R/quant_moe.log" 2>/dev/null | cut -c1-260
grep -E "M=   1|lm_head" "$R/quant_dense.log" 2>/dev/null | cut -c1-220 | head -n 20
