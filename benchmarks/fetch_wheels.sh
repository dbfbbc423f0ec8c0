#!/usr/bin/env bash
# Fetch, here, the wheels the GPU machine lacks for the serving benchmarks (gpu_offload_run.sh):
# it has no network, and its image (Python 3.12, torch 2.11, triton 3.6, transformers 5.17,
# tokenizers, safetensors, numpy, jinja2, tqdm, anyio, h11, httpx, click, msgpack, einops,
# huggingface-hub) has no fastapi/uvicorn/pydantic and no FreeToken. They go to .whl/ in the
# repo root (ignored by git; the device call carries it) and are installed there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#
# moeferry serve:  fastapi starlette pydantic pydantic-core annotated-types typing-inspection
#                  typing-extensions annotated-doc opentelemetry-api (fastapi 0.165 imports it) uvicorn
# FreeToken 0.1.2: freetoken flashlib apache-tvm-ffi pyzmq gguf partial-json-parser prompt_toolkit
#                  wcwidth openai<3 (2.x) distro jiter sniffio, plus the server set above
# Versions are pinned (one version of each: two stop the install); cp312 manylinux x86_64.
# About 12 MiB in all (2026-12-03). Usage: bash benchmarks/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  uvicorn==0.55.0
  freetoken==0.1.2 flashlib==0.3.0 apache-tvm-ffi==0.1.13.post3 pyzmq==27.3.0 gguf==0.19.0
  partial-json-parser==0.2.1.1.post7 prompt_toolkit==3.0.53 wcwidth==0.9.4 openai==2.54.0 distro==1.9.0
  jiter==0.19.0 sniffio==1.3.1
)
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
# one version per package: drop any other version left in .whl by an earlier fetch
keep=$(printf '%s\n' "${WHEELS[@]}" | sed 's/==/-/; s/[-_.]/_/g' | tr 'A-Z' 'a-z')
for f in .whl/*.whl; do
  stem=$(basename "$f" | cut -d- -f1-2 | sed 's/[-_.]/_/g' | tr 'A-Z' 'a-z')
  grep -qx "$stem" <<<"$keep" || { echo "removing $f (not in the pinned list)"; rm -f "$f"; }
done
n=$(ls .whl/*.whl | wc -l)
size=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "$n wheels in .whl, $((size / 1048576)) MiB"
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels" >&2; exit 1; }
[ "$size" -lt $((40 * 1048576)) ] || { echo "over 40 MiB: the device call carries at most 64 MiB" >&2; exit 1; }
