#!/usr/bin/env bash
# Device driver for the FreeToken layout proof (issue 5). Run from the repo root on the GPU
# machine with the wheels carried in .whl/ (see README "Supported checkpoint formats"):
#   bash benchmarks/freetoken_layout.sh [OUT_DIR] [extra args for freetoken_layout.py]
# Installs FreeToken 0.1.2 and its missing dependencies from .whl/ into /tmp/site, then
# writes each checkpoint, boots `python -m freetoken` on it and sends one chat request.
# Wheels (cp312 manylinux x86_64, ~15 MiB; fetched with `pip download --no-deps`, see
# /work/.library/device/README.md): freetoken==0.1.2 flashlib==0.3.0
# apache-tvm-ffi==0.1.13.post3 fastapi starlette pydantic pydantic-core typing-inspection
# annotated-types typing-extensions uvicorn opentelemetry-api (fastapi>=0.165 imports it)
# pyzmq gguf partial-json-parser prompt_toolkit wcwidth openai<3 distro jiter sniffio.
# The image already has torch 2.11/triton 3.6/transformers 5.17/tokenizers/msgpack/einops.
# Run 2026-12-02 on one H200: both presets booted and answered (157 s in all).
set -uo pipefail
OUT_DIR=${1:-${OUT:-/tmp/ftl_out}}; shift || true
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  echo "== env"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, triton, transformers, tokenizers, safetensors; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__)'
  echo "== install wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c 'import freetoken, flashlib, tvm_ffi, fastapi, zmq, openai, partial_json_parser; print("freetoken", freetoken.__file__)' || exit 4
  echo "== run"
  python3 benchmarks/freetoken_layout.py --out "$OUT_DIR" "$@"
} 2>&1 | tee "$OUT_DIR/driver.log"
exit "${PIPESTATUS[0]}"
