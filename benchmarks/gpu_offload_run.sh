#!/usr/bin/env bash
# Issues 11 + 12 on the lent GPU machine, in one call: install the carried wheels (.whl/, see
# fetch_wheels.sh), write the full-depth Qwen3.6-35B-A3B mixed_nvfp4 checkpoint, then run the
# benchmarks in RUNS order, each under its own time limit, while BUDGET_S seconds last (a run
# whose estimate no longer fits is skipped and says so). Results are collected after every run,
# so a hard kill still returns them. Run from the repo root:
#   bash benchmarks/gpu_offload_run.sh
# Device call: carry [".whl"], timeout_s about BUDGET_S + 60; the command is just this line.
# Runs (default "seed offload skew"):
#   seed      seed_scenario.py: the seed's flags verbatim, 8 prompts x 8192, ballast LEAVE_GIB (issue 12)
#   offload   offload.py: --moe-backend offload --moe-cache-size CACHE_SIZE, both engines (issue 11)
#   offload_bf16  offload.py, both engines, on a bf16 checkpoint of BF16_LAYERS (default 24) layers at BF16_CACHE_SIZE
#             slots (default 1200 of 24 x 256 experts of 6 MiB: 7 GiB, what 14.6 GiB free holds beside the bf16 dense weights, KV
#             and prefill): a full-depth bf16 checkpoint (~68 GB)
#             does not fit the lent machines' 64 GiB disk; removes the main checkpoint first
#   hybrid_bf16  offload_bf16's checkpoint and slots, moeferry alone with --moe-backend hybrid
#   hybrid    offload.py with moeferry --moe-backend hybrid (alone, same cache size and ballast; issue 11's hybrid question)
#   offload_nopf  the same, moeferry alone, decode prefetch off (what the prefetch is worth)
#   offload_ca  offload with moeferry's kernels compiled ahead (--compile-workers COMPILE_WORKERS, default 8), both
#             engines (with FRESH_TRITON=1 each boots cold)
#   offload_w8  offload, moeferry alone, the prefetch copying all of 8 guessed a row (the default before the eighteenth session)
#   offload_w4  offload, moeferry alone, the prefetch copying all of 4 guessed a row (the default before the twenty-fifth)
#   bw        `moeferry bench bw` on a 4-layer mixed_nvfp4 checkpoint (copies, gather configs, CPU expert times)
#   skew      its own checkpoint with --router-skew SKEW, offload.py on it (moeferry; both if SKEW_FT=1, then
#             under OFFLOAD_MAX_S)
#   seed_c4   --max-running-requests 4, 4 concurrent 8k prompts
#   seed_32k  --max-extend-tokens 32768, two 32768-token prompts
#   agent     the seed's flags, no prompt wave: 4 turns of one conversation from 98304 tokens (+512 a
#             turn), each turn's time to first token and the cached tokens each server reports
#   seed_10g  ballast leaving 10 GiB
#   seed_int4 an int4_awq checkpoint (same geometry), the seed's flags
#   bench     bench_serve.py: `moeferry bench serve` against both engines, BENCH_FLAGS, no ballast (issue 14)
#   numa      numa_h2d.py: host-to-device copy and gather rates from pinned memory on each NUMA node, and under
#             the engine's policy (memory.numa: the GPU's node preferred) (issue 11)
#   moe       quant_decode.py moe: the MoE decode path against the grouped-GEMM path (issue 13 item 3)
#   load      load_speed.py: loading per layer, old and new paths, and load_model (issue 13 item 5)
#   prepskew  in parallel: the skewed checkpoint (skew's) and gputests
#   prepbf16  in parallel: the bf16_12 checkpoint and gputests
#   loadcmp   load_speed.py on 4-layer mixed_nvfp4 and bf16 checkpoints: per-layer expert paths, whole
#             load_model per backend, the templated copies (C call / Python threads / bound), and
#             quantized loading per byte against bf16's (issue 13 item 5)
#   prefill   prefill_kernels.py: attention (paged Triton against SDPA flash) and the Gated DeltaNet
#             prefill's kernel variants at 2048 / 8192 tokens (issue 13: the bf16_12 prefill)
#   prep      in parallel: the main checkpoint and gputests
#   prep13    in parallel (no timing runs then): the main checkpoint, the bf16_12 checkpoint and gputests
#   resident  offload.py, no ballast: moeferry --moe-backend resident against FreeToken with every expert
#             cached (--moe-backend offload --moe-cache-size 10240: it refuses NVFP4 with fused) (issue 13)
#   resident_plain  the same, moeferry alone, each step's tokens read before the next step (what the overlap is worth)
#   bf16_12   a 12-layer bf16 checkpoint, offload.py with --moe-backend fused on both, no ballast (issue 13)
#   e2e       quant_decode.py e2e: in-process resident decode b1/b4/b16 and an eager profile (issue 13)
#   e2e_bf16  the same on the 12-layer bf16 checkpoint (bf16_12's): its decode and 8192-token prefill profiles
#   e2e_offload  quant_decode.py e2e --offload CACHE_SIZE: in-process offload decode, graphs with the
#             cache managed on the device, piecewise graphs, eager; where a piecewise step's time goes (no ballast)
#   e2e_widths  quant_decode.py e2e --offload CACHE_SIZE --policies lru --widths WIDTHS (default 4,5,6,7,8): in-process
#             device-managed decode with the prefetch guessing each width a row (bytes, hit rate, tok/s; no ballast)
#   e2e_aside  quant_decode.py e2e --offload CACHE_SIZE --policies lru --aside: in-process device-managed decode
#             with a layer's side work (guess, placement, shared expert) on the side stream and in line, then the
#             own gather's grid capped at the prefetch's and twice it (no ballast)
#   e2e_launch  quant_decode.py e2e --offload CACHE_SIZE --policies lru --launch: where a device-managed b1 step's time
#             outside its kernels goes (graph launches: host call, start to first kernel, back-to-back replays), with the
#             step's streams as configured, its side work in line and one stream (no ballast)
#   e2e_budget  quant_decode.py e2e --offload CACHE_SIZE --policies lru --budgets BUDGETS: device-managed decode with the
#             prefetch guessing W a row and copying at most B of them (BUDGETS "W:B,...", default 4:4,8:2,8:3,6:2,8:8),
#             sync loop and back-to-back replays (no ballast)
#   e2e_skew_budget  the same on skew's checkpoint under lfu (BUDGETS default 4:4,8:2)
#   e2e_skew_widths  the same on skew's checkpoint under lfu (WIDTHS default 4,6,8)
#   e2e_skew  quant_decode.py e2e --offload CACHE_SIZE --policies lru,lfu --orders on skew's checkpoint: in-process
#             device-managed decode under each policy, then the prefetch started before / after the layer's own gather
#   sampling  sampling.py: the sampler's general path against the top-k short path, Qwen3.6's vocabulary
#   inputs    graph_inputs.py: a decode step's page-table host time against context length (PageRows)
#   gputests  pytest -m gpu over the files with the gpu marker, one process per file in parallel (GPUTESTS: files
#             and pytest arguments), -vv
#   lanes     the miss lanes on a 4-layer skewed (1.0) checkpoint: `moeferry bench bw`, cpu_experts.py (the CPU
#             lane's C kernel against the PyTorch reference) and offload_engine.py offload / hybrid / cpu at 25%,
#             and offload with 2 of the 4 MoE layers on the CPU (--moe-cpu-layers 2)
# Returned under $OUT: results.md (every table), results.json, logs.tgz (server, ballast and
# make-model logs), driver.log, gpu.txt.
# Knobs (env): BUDGET_S, RUNS, SEED_EST_S (the seed run's estimate, default 150), SEED_MAX_S / OFFLOAD_MAX_S (those runs' limits, default 360 / 400: FreeToken 0.1.2 boots in 70-110 s), LEAVE_GIB (empty: no ballast), CACHE_SIZE, MOE_BACKEND (the offload runs' backend, default offload), SKEW, SKEW_FT, FT_ARGS,
# BENCH_FLAGS / BENCH_ARGS (serve flags of both engines / bench_serve.py options of the bench run),
# SIZE / LAYERS / QUANT_DEVICE (make-model geometry, quantizer device; empty = CPU), SEED_ARGS / OFFLOAD_ARGS (appended to every seed_scenario.py /
# offload.py call), GPUTESTS (the gputests run's test files and the pytest arguments each file's run gets; default the files with the gpu marker), GPUTESTS_MAX_S, SKIP_WHEELS=1 (a machine that has the packages), FRESH_TRITON=1 (every run compiles into its own empty Triton cache).
# moeferry's own flags reach its servers only, through the environment (e.g. MOEFERRY_MOE_CACHE_POLICY=lfu). A CPU wiring check:
#   SKIP_WHEELS=1 SIZE=tiny QUANT_DEVICE= LEAVE_GIB= CACHE_SIZE=12 RUNS="seed offload" SEED_ARGS="--host 127.0.0.1 --prompts 2 \
#   --prompt-tokens 64" OFFLOAD_ARGS="--prefill 64 --out-tokens 8" bash benchmarks/gpu_offload_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/moeferry-offload-out}
WORK=${WORK:-/tmp/mfbench}
BUDGET_S=${BUDGET_S:-450}
RUNS=${RUNS:-seed offload skew}
LEAVE_GIB=${LEAVE_GIB-14.6}
CACHE_SIZE=${CACHE_SIZE:-3600}
SKEW=${SKEW:-0.3}
SIZE=${SIZE:-qwen3.6-35b-a3b}
LAYERS=${LAYERS:-}
QUANT_DEVICE=${QUANT_DEVICE-cuda}
SEED_ARGS=${SEED_ARGS:-}
OFFLOAD_ARGS=${OFFLOAD_ARGS:-}
FT_ARGS=${FT_ARGS:---attention-backend triton}
BENCH_FLAGS=${BENCH_FLAGS:---moe-backend offload --moe-cache-size 10240 --max-running-requests 8 --max-seq-len-override 8192}
MOE_BACKEND=${MOE_BACKEND:-offload}  # the offload runs' backend (hybrid, cpu: ours alone, OFFLOAD_ARGS="--engines moeferry")
OFFLOAD_FLAGS="--moe-backend $MOE_BACKEND --moe-cache-size $CACHE_SIZE --max-running-requests 4 --max-seq-len-override 32768"
PEER_FLAGS="--max-running-requests 4 --max-seq-len-override 32768"  # the resident runs' shared flags
T_START=$(date +%s)
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
export MOEFERRY_BENCH_PIDS="$WORK/pids"
: > "$MOEFERRY_BENCH_PIDS"

left() { echo $(( BUDGET_S - $(date +%s) + T_START )); }

cleanup() {  # process groups the scripts started and left behind (after a hard kill), by their ids
  while read -r pid; do kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null; done < "$MOEFERRY_BENCH_PIDS"
  : > "$MOEFERRY_BENCH_PIDS"
}

collect() {  # every table and result so far into $OUT (at most 8 files come back)
  local runs r md
  runs=$(cd "$WORK" && ls -d */ 2>/dev/null | grep -v '^ckpt\|^triton' | tr -d /)
  : > "$OUT/results.md"
  for r in $runs; do for md in "$WORK/$r"/*.md; do
    [ -f "$md" ] && { echo "## $r"; cat "$md"; echo; } >> "$OUT/results.md"; done; done
  python3 -c '
import json, pathlib, sys
work, out = pathlib.Path(sys.argv[1]), {}
for run in sys.argv[3:]:
    for f in sorted((work / run).glob("*.json")):
        out[f"{run}/{f.stem}"] = json.loads(f.read_text())
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1) + "\n")
' "$WORK" "$OUT/results.json" $runs
  (cd "$WORK" && tar czf "$OUT/logs.tgz" $runs $(ls make_*.log 2>/dev/null))
}

# step NAME ESTIMATE_S MAX_S CMD...: run CMD under a time limit if ESTIMATE_S still fits the budget
step() {
  local name=$1 est=$2 max=$3; shift 3
  local l lim t rc
  l=$(left)
  if [ "$l" -lt "$est" ]; then echo "== $name: SKIPPED (${l} s left, needs about ${est} s)"; return 1; fi
  lim=$(( max < l - 10 ? max : l - 10 ))
  echo "== $name: up to ${lim} s ($(date -u +%T))"
  t=$(date +%s)
  # FRESH_TRITON=1: each run compiles into an empty Triton cache of its own (cold boots compare)
  [ "${FRESH_TRITON:-0}" = 1 ] && export TRITON_CACHE_DIR="$WORK/triton/$name"
  timeout -k 15 "$lim" bash -c '"$@"' "$name" "$@"; rc=$?
  cleanup
  echo "== $name: rc=$rc in $(( $(date +%s) - t )) s"
  collect
  return $rc
}

make_ckpt() {  # make_ckpt DIR SKEW [QUANT (bf16: none) [LAYERS]]; a checkpoint a warm machine already holds is kept
  local logf="$WORK/make_$(basename "$1").log" rc quant=${3:-mixed_nvfp4} layers=${4:-$LAYERS}
  # bf16 as released (HF's fused experts, which FreeToken's fused backend requires); quantized ones per expert
  local layout; layout=$([ "$quant" = bf16 ] && echo fused || echo per-expert)
  [ -f "$1/.made-$2-$quant-$layout" ] && { echo "kept $1 (made by an earlier call)"; return 0; }
  rm -rf "$1"
  MOEFERRY_QUANT_DEVICE=$QUANT_DEVICE python3 -m moeferry.cli make-model --arch qwen3_5_moe --size "$SIZE" \
    ${layers:+--num-layers $layers} --multimodal --dtype bfloat16 $([ "$quant" = bf16 ] || echo "--quant $quant") \
    --expert-layout "$layout" --router-skew "$2" --out "$1" > "$logf" 2>&1
  rc=$?; tail -n 3 "$logf"; du -sh "$1"
  [ $rc = 0 ] && touch "$1/.made-$2-$quant-$layout"; return $rc
}

bf16_12_ckpt() { step make_bf16_12 60 200 make_ckpt "$WORK/ckpt_bf16_12" 0 bf16 12; }
bf16_ckpt() {  # offload_bf16's checkpoint, BF16_LAYERS deep; the main one is removed (the disk holds one big checkpoint)
  rm -rf "$WORK/ckpt"; step make_bf16 60 360 make_ckpt "$WORK/ckpt_bf16" 0 bf16 "${BF16_LAYERS:-24}"; }

seed() {  # seed NAME [seed_scenario.py args...]
  local name=$1; shift
  python3 benchmarks/seed_scenario.py --model "$WORK/ckpt" --out "$WORK/$name" --name "$name" \
    ${LEAVE_GIB:+--leave-gib $LEAVE_GIB} --ft-args "$FT_ARGS" --boot-timeout 180 --request-timeout 60 \
    --engine-budget 100 "$@" ${SEED_ARGS:-}
}

offload() {  # offload NAME MODEL [offload.py args...]
  local name=$1 model=$2; shift 2
  python3 benchmarks/offload.py --model "$model" --out "$WORK/$name" ${LEAVE_GIB:+--leave-gib $LEAVE_GIB} \
    --flags "$OFFLOAD_FLAGS" --ft-args "$FT_ARGS" --boot-timeout 180 --request-timeout 60 --engine-budget 70 \
    "$@" ${OFFLOAD_ARGS:-}
}

offload_slots() {  # offload_slots SLOTS NAME MODEL [offload.py args...]: offload() with another --moe-cache-size
  local slots=$1; shift
  OFFLOAD_FLAGS="${OFFLOAD_FLAGS/--moe-cache-size $CACHE_SIZE/--moe-cache-size $slots}" offload "$@"
}

peer() {  # peer NAME MODEL SHARED_FLAGS OURS_FLAGS FT_FLAGS [offload.py args...]: offload.py without ballast, per-engine flags
  local name=$1 model=$2 shared=$3 ours=$4 ft=$5; shift 5
  python3 benchmarks/offload.py --model "$model" --out "$WORK/$name" --flags "$shared" --ours-args "$ours" \
    --ft-args "$FT_ARGS $ft" --boot-timeout 200 --request-timeout 60 --engine-budget 70 "$@" ${OFFLOAD_ARGS:-}
}

gputests() {  # the files that carry the gpu marker (the others import the API clients the GPU host lacks), one
  # pytest process per file, all at once (they mostly compile kernels and build checkpoints on the CPU); each
  # test's name and outcome as it runs, so a run cut by its limit still says how far each file got.
  # GPUTESTS: test files (tests/...) and pytest arguments given to every file's run
  local words=${GPUTESTS:-$(grep -l "pytest.mark.gpu" tests/*.py | tr '\n' ' ')} files=() args=() w f rc=0
  for w in $words; do case $w in tests/*) files+=("$w") ;; *) args+=("$w") ;; esac; done
  mkdir -p "$WORK/gputests"
  local max=${GPUTESTS_MAX_S:-300} l; l=$(left); [ "$l" -lt "$max" ] && max=$l
  for f in "${files[@]}"; do
    timeout -k 5 "$(( max - 20 ))" python3 -m pytest "$f" -m gpu -vv -p no:cacheprovider -rf --durations=5 \
      "${args[@]}" > "$WORK/gputests/$(basename "${f%%::*}" .py).log" 2>&1 &
  done
  for f in "${files[@]}"; do wait -n || rc=1; done
  for f in "$WORK"/gputests/*.log; do
    echo "### $(basename "$f" .log)"
    grep -E "(PASSED|FAILED|ERROR|SKIPPED)" "$f" | grep "::" | sed 's/ *\[ *[0-9]*%\]//'
    tail -n 12 "$f"
  done > "$WORK/gputests/pytest.md"
  return $rc
}

export -f left make_ckpt seed offload offload_slots peer gputests  # step runs them under timeout, in a child bash
export CACHE_SIZE SKEW T_START BUDGET_S WORK LEAVE_GIB FT_ARGS SIZE LAYERS QUANT_DEVICE OFFLOAD_FLAGS PEER_FLAGS SEED_ARGS OFFLOAD_ARGS

{
  echo "== env ($(date -u +%T))"
  { nvidia-smi --query-gpu=name,memory.total,memory.used,memory.free,driver_version --format=csv
    python3 -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__)'
    nproc; free -g | head -2; df -h "$WORK" | tail -1; lscpu | grep -i -E "numa|socket|model name"
    nvidia-smi topo -m; } > "$OUT/gpu.txt" 2>&1
  cat "$OUT/gpu.txt"
  if [ "${SKIP_WHEELS:-0}" != 1 ]; then
    echo "== wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
    python3 -c 'import fastapi, uvicorn, pydantic, freetoken, flashlib, tvm_ffi, zmq
print("wheels ok: fastapi", fastapi.__version__, "freetoken", freetoken.__file__)' || exit 4
  fi
  needs_ckpt=0  # prep13 makes the checkpoint itself, alongside other work; some runs do not read it
  for run in $RUNS; do case $run in prep|prep13) needs_ckpt=0; break ;; bf16_12|e2e_bf16|prepbf16|offload_bf16|hybrid_bf16|prefill|loadcmp|bw|gputests|numa|moe|sampling|inputs|skew|prepskew|e2e_skew|e2e_skew_widths|e2e_skew_budget|lanes) ;;
    *) needs_ckpt=1 ;; esac; done
  if [ "$needs_ckpt" = 1 ]; then
    step make 60 300 make_ckpt "$WORK/ckpt" 0 || { echo "no checkpoint: stopping"; exit 5; }
  fi
  for run in $RUNS; do
    case $run in
      seed)     step seed ${SEED_EST_S:-150} ${SEED_MAX_S:-360} seed seed ;;
      seed_c4)  step seed_c4 250 360 seed seed_c4 --extra-flags "--max-running-requests 4" --concurrency 4 --prompts 4 ;;
      seed_32k) step seed_32k 250 360 seed seed_32k --extra-flags "--max-extend-tokens 32768" --prompt-tokens 32768 --prompts 2 ;;
      agent)    step agent 300 420 seed agent --prompts 0 --prompt-tokens 98304 --agent-turns 4 --turn-tokens 512 ;;
      seed_10g) step seed_10g 250 360 seed seed_10g --leave-gib 10 ;;
      seed_int4) step make_int4 200 300 make_ckpt "$WORK/ckpt_int4" 0 int4_awq \
                  && step seed_int4 250 360 seed seed_int4 --model "$WORK/ckpt_int4" ;;
      bench)    step bench 200 400 python3 benchmarks/bench_serve.py --model "$WORK/ckpt" --out "$WORK/bench" \
                  --flags "$BENCH_FLAGS" --ft-args "$FT_ARGS" --boot-timeout 180 --request-timeout 240 ${BENCH_ARGS:-} ;;
      numa)     step numa 20 120 bash -c "python3 benchmarks/numa_h2d.py --out $WORK/numa \
                  && python3 benchmarks/numa_h2d.py --prefer --out $WORK/numa" ;;
      moe)      step moe 200 480 python3 benchmarks/quant_decode.py moe --out "$WORK/moe" ;;
      load)     step load 60 200 python3 benchmarks/load_speed.py --model "$WORK/ckpt" --device cuda --layers 3 \
                  --load-model ;;
      prep)     step prep 120 300 bash -c 'gputests & make_ckpt "$WORK/ckpt" 0; rc=$?; wait; exit $rc' \
                  || { echo "no checkpoint: stopping"; break; } ;;
      prep13)   step prep13 120 300 bash -c 'gputests & make_ckpt "$WORK/ckpt_bf16_12" 0 bf16 12 & \
                  make_ckpt "$WORK/ckpt" 0; rc=$?; wait; exit $rc' || { echo "no checkpoint: stopping"; break; } ;;
      prepbf16) step prepbf16 120 300 bash -c 'gputests & make_ckpt "$WORK/ckpt_bf16_12" 0 bf16 12; rc=$?; wait; \
                  exit $rc' || { echo "no bf16_12 checkpoint: stopping"; break; } ;;
      loadcmp)  step make_load4 60 200 make_ckpt "$WORK/ckpt_load4" 0 mixed_nvfp4 4 \
                  && step make_load4_bf16 60 200 make_ckpt "$WORK/ckpt_load4_bf16" 0 bf16 4 \
                  && step loadcmp 60 240 python3 benchmarks/load_speed.py --model "$WORK/ckpt_load4" --device cuda \
                  --layers 4 --load-model --copies --compare "$WORK/ckpt_load4_bf16" --out "$WORK/loadcmp" ;;
      prefill)  step prefill 90 240 python3 benchmarks/prefill_kernels.py --out "$WORK/prefill" ;;
      prepskew) step prepskew 200 300 bash -c 'gputests & make_ckpt "$WORK/ckpt_skew" "$SKEW"; rc=$?; wait; exit $rc' \
                  || { echo "no skewed checkpoint: stopping"; break; } ;;
      resident) step resident 250 400 peer resident "$WORK/ckpt" "$PEER_FLAGS" "--moe-backend resident" \
                  "--moe-backend offload --moe-cache-size 10240" ;;
      resident_plain) step resident_plain 120 240 peer resident_plain "$WORK/ckpt" "$PEER_FLAGS" \
                  "--moe-backend resident --disable-overlap-schedule" "" --engines moeferry ;;
      bf16_12)  bf16_12_ckpt && step bf16_12 180 300 peer bf16_12 "$WORK/ckpt_bf16_12" "--moe-backend fused $PEER_FLAGS" "" "" ;;
      e2e)      step e2e 120 240 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt" --out "$WORK/e2e" --profile ;;
      e2e_bf16) bf16_12_ckpt && step e2e_bf16 120 240 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt_bf16_12" \
                  --out "$WORK/e2e_bf16" --profile ;;
      e2e_offload) step e2e_offload 220 360 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt" --out "$WORK/e2e_offload" \
                  --offload "$CACHE_SIZE" ;;
      e2e_widths) step e2e_widths 180 300 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt" --out "$WORK/e2e_widths" \
                  --offload "$CACHE_SIZE" --policies lru --widths "${WIDTHS:-4,5,6,7,8}" ;;
      e2e_launch) step e2e_launch 150 300 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt" --out "$WORK/e2e_launch" \
                  --offload "$CACHE_SIZE" --policies lru --launch ;;
      e2e_budget) step e2e_budget 150 360 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt" --out "$WORK/e2e_budget" \
                  --offload "$CACHE_SIZE" --policies lru --budgets "${BUDGETS:-4:4,8:2,8:3,6:2,8:8}" ;;
      e2e_skew_budget) step make_skew 200 300 make_ckpt "$WORK/ckpt_skew" "$SKEW" \
                  && step e2e_skew_budget 120 300 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt_skew" \
                  --out "$WORK/e2e_skew_budget" --offload "$CACHE_SIZE" --policies lfu --budgets "${BUDGETS:-4:4,8:2}" ;;
      e2e_aside) step e2e_aside 150 300 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt" --out "$WORK/e2e_aside" \
                  --offload "$CACHE_SIZE" --policies lru --aside ;;
      e2e_skew_widths) step make_skew 200 300 make_ckpt "$WORK/ckpt_skew" "$SKEW" \
                  && step e2e_skew_widths 150 300 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt_skew" \
                  --out "$WORK/e2e_skew_widths" --offload "$CACHE_SIZE" --policies lfu --widths "${WIDTHS:-4,6,8}" ;;
      e2e_skew) step make_skew 200 300 make_ckpt "$WORK/ckpt_skew" "$SKEW" \
                  && step e2e_skew 200 380 python3 benchmarks/quant_decode.py e2e "$WORK/ckpt_skew" \
                  --out "$WORK/e2e_skew" --offload "$CACHE_SIZE" --policies lru,lfu --orders ;;
      sampling) step sampling 30 90 bash -c "mkdir -p $WORK/sampling; python3 benchmarks/sampling.py --device cuda > $WORK/sampling/sampling.md" ;;
      inputs)   step inputs 20 90 bash -c "mkdir -p $WORK/inputs; python3 benchmarks/graph_inputs.py --device cuda > $WORK/inputs/graph_inputs.md" ;;
      gputests) step gputests 120 ${GPUTESTS_MAX_S:-300} gputests ;;
      lanes)    step make_lanes 60 200 make_ckpt "$WORK/ckpt_lanes" 1.0 mixed_nvfp4 4 \
                  && step lanes 150 300 bash -c "mkdir -p $WORK/lanes && cd $PWD \
                  && python3 -m moeferry.cli bench bw --model $WORK/ckpt_lanes > $WORK/lanes/bw.md \
                  && python3 benchmarks/cpu_experts.py --formats nvfp4,int4_awq > $WORK/lanes/cpu_experts.md \
                  && python3 benchmarks/offload_engine.py --model $WORK/ckpt_lanes --out $WORK/lanes \
                     --backends offload-25% hybrid-25% cpu-25% offload-25%-cpu-layers-2" ;;
      offload)  step offload 250 ${OFFLOAD_MAX_S:-400} offload offload "$WORK/ckpt" ;;
      offload_ca) step offload_ca 250 ${OFFLOAD_MAX_S:-400} offload offload_ca "$WORK/ckpt" \
                  --ours-args "--compile-workers ${COMPILE_WORKERS:-8}" ;;
      hybrid)   step hybrid 150 240 offload hybrid "$WORK/ckpt" --engines moeferry --ours-args "--moe-backend hybrid" ;;
      offload_bf16) bf16_ckpt && step offload_bf16 250 ${OFFLOAD_MAX_S:-400} offload_slots "${BF16_CACHE_SIZE:-1200}" \
                  offload_bf16 "$WORK/ckpt_bf16" ;;
      hybrid_bf16) bf16_ckpt && step hybrid_bf16 120 240 offload_slots "${BF16_CACHE_SIZE:-1200}" hybrid_bf16 \
                  "$WORK/ckpt_bf16" --engines moeferry --ours-args "--moe-backend hybrid" ;;
      offload_w8) step offload_w8 150 240 offload offload_w8 "$WORK/ckpt" --engines moeferry \
                  --ours-args "--moe-prefetch-width 8 --moe-prefetch-budget 8" ;;
      offload_w4) step offload_w4 150 240 offload offload_w4 "$WORK/ckpt" --engines moeferry \
                  --ours-args "--moe-prefetch-width 4 --moe-prefetch-budget 4" ;;
      offload_nopf) step offload_nopf 150 240 offload offload_nopf "$WORK/ckpt" --engines moeferry \
                  --ours-args "--disable-moe-decode-prefetch" ;;
      bw)       step make_load4 60 200 make_ckpt "$WORK/ckpt_load4" 0 mixed_nvfp4 4 \
                  && step bw 30 120 bash -c "mkdir -p $WORK/bw && python3 -m moeferry.cli bench bw \
                  --model $WORK/ckpt_load4 > $WORK/bw/bw.md" ;;
      skew)     step make_skew 200 300 make_ckpt "$WORK/ckpt_skew" "$SKEW" \
                  && step skew 70 "$([ "${SKEW_FT:-0}" = 1 ] && echo "${OFFLOAD_MAX_S:-400}" || echo 200)" offload skew \
                  "$WORK/ckpt_skew" --engines "moeferry$([ "${SKEW_FT:-0}" = 1 ] && echo ,freetoken)" ;;
      *)        echo "== unknown run $run" ;;
    esac
  done
  collect
  echo "== all done in $(( $(date +%s) - T_START )) s"
  cat "$OUT/results.md"
} 2>&1 | tee "$OUT/driver.log"
