"""Layout proof against FreeToken 0.1.2: boot it on our synthetic quantized checkpoints.

FreeToken's Qwen3.5/3.6-MoE loader was written against the public releases
(nvidia/Qwen3.6-35B-A3B-NVFP4: ModelOpt MIXED_PRECISION; Qwen/Qwen3.6-35B-A3B-FP8: 128x128
block FP8). It reads tensors by name (`model.language_model.layers.N.mlp.experts.E.*`),
fuses projections by name, checks every shape and dtype against its model buffers and
rejects unexpected keys. So a checkpoint from `moeferry make-model --quant ...` that it
boots and answers a chat request on has the same names, shapes, dtypes and config files as
those releases.

For each preset: write a real-geometry checkpoint (`--size qwen3.6-35b-a3b --num-layers N
--multimodal --dtype bfloat16`), start `python -m freetoken --model DIR ...`, wait for
/health, POST one /v1/chat/completions, stop the server. The next checkpoint is written
while the server boots. Everything goes to --out: `<preset>.make.txt` (make-model output
plus the checkpoint's tensor layout), `<preset>.freetoken.log` and `summary.json`.

    python benchmarks/freetoken_layout.py --out $OUT --work /tmp/ftl --presets mixed_nvfp4 fp8_block

Used by benchmarks/freetoken_layout.sh (the device driver, which installs the wheels).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


SIZE = "qwen3.6-35b-a3b"


def make_cmd(preset: str, out: Path, layers: int) -> list[str]:
    return [sys.executable, "-m", "moeferry.cli", "make-model", "--arch", "qwen3_5_moe",
            "--size", SIZE, "--num-layers", str(layers), "--multimodal",
            "--dtype", "bfloat16", "--quant", preset, "--out", str(out)]


def start_make(preset: str, work: Path, outdir: Path, layers: int, device: str | None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device:
        env["MOEFERRY_QUANT_DEVICE"] = device
    logf = open(outdir / f"{preset}.make.txt", "a")
    logf.write(f"$ {' '.join(make_cmd(preset, work / preset, layers))}  (MOEFERRY_QUANT_DEVICE={device})\n")
    logf.flush()
    return subprocess.Popen(make_cmd(preset, work / preset, layers), cwd=REPO, env=env,
                            stdout=logf, stderr=subprocess.STDOUT), logf


def finish_make(preset, proc, logf, work, outdir, layers, t_start) -> dict:
    rc = proc.wait()
    if rc != 0:  # retry once on the CPU (the accelerator path is an optimisation)
        log(f"{preset}: make-model rc={rc} with the accelerator quantizer; retrying on the CPU")
        logf.close()
        proc, logf = start_make(preset, work, outdir, layers, None)
        rc = proc.wait()
    res = {"make_rc": rc, "make_s": round(time.time() - t_start, 1)}
    if rc == 0:
        res["layout"] = describe(work / preset, logf)
    logf.close()
    return res


def describe(path: Path, logf) -> dict:
    """Tensor names/dtypes/shapes of one GDN layer, one attention layer, lm_head; config files."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    rows, total = [], 0
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                total += 1
                keep = (".layers.0." in k and (".experts.0." in k or ".experts." not in k)) or \
                       (".layers.3.self_attn." in k) or k.startswith("lm_head") or "embed_tokens" in k
                if keep and not k.startswith("mtp."):
                    sl = h.get_slice(k)
                    rows.append(f"{k}  {sl.get_dtype()}  {sl.get_shape()}")
    logf.write(f"\n# {path}: {total} tensors in {len(files)} files, "
               f"{sum(f.stat().st_size for f in files) / 2**30:.2f} GiB\n")
    logf.write("\n".join(sorted(rows)) + "\n")
    cfg = json.loads((path / "config.json").read_text())
    logf.write("\n# config.json quantization_config\n" + json.dumps(cfg.get("quantization_config"), indent=1)[:6000] + "\n")
    hq = path / "hf_quant_config.json"
    if hq.is_file():
        logf.write("\n# hf_quant_config.json (head)\n" + hq.read_text()[:3000] + "\n")
    logf.flush()
    return {"tensors": total, "files": len(files), "gib": round(sum(f.stat().st_size for f in files) / 2**30, 2)}


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def serve(preset: str, model: Path, outdir: Path, port: int, boot_timeout: float, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "freetoken", "--model", str(model), "--port", str(port),
           "--dtype", "bfloat16", "--attention-backend", "triton", "--cuda-graph-max-bs", "0",
           "--num-tokens", "8192", "--max-running-requests", "4", "--max-seq-len-override", "4096",
           "--expert-load", "serial", *extra]
    logf = open(outdir / f"{preset}.freetoken.log", "w")
    logf.write("$ " + " ".join(cmd) + "\n")
    logf.flush()
    t = time.time()
    proc = subprocess.Popen(cmd, cwd="/tmp", stdout=logf, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    res: dict = {"cmd": " ".join(cmd)}
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                res.update(booted=False, exit=proc.returncode, boot_s=round(time.time() - t, 1))
                return res
            if time.time() - t > boot_timeout:
                res.update(booted=False, exit="boot timeout", boot_s=round(time.time() - t, 1))
                return res
            try:  # /health: {"status": "loading" | "ok" | "error", ...}
                status, body = http("GET", base + "/health", timeout=2)
                res["health"] = body[:500]
                state = json.loads(body).get("status")
                if state == "ok":
                    break
                if state == "error":
                    res.update(booted=False, exit="health error", boot_s=round(time.time() - t, 1))
                    return res
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
                pass
            time.sleep(1.0)
        res["boot_s"] = round(time.time() - t, 1)
        res["booted"] = True
        body = {"model": model.name, "messages": [{"role": "user", "content": "Hello! Say something."}],
                "max_tokens": 24, "temperature": 0}
        t2 = time.time()
        for attempt in range(20):
            try:
                status, text = http("POST", base + "/v1/chat/completions", body, timeout=60)
                res["chat_status"] = status
                res["chat"] = json.loads(text)
                break
            except urllib.error.HTTPError as e:
                res["chat_status"] = e.code
                res["chat_error"] = e.read().decode()[:1000]
                if e.code not in (502, 503):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                res["chat_error"] = repr(e)
            if proc.poll() is not None:
                break
            time.sleep(1.0)
        res["chat_s"] = round(time.time() - t2, 1)
        return res
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        logf.close()


def main() -> int:
    global SIZE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ftl")
    ap.add_argument("--presets", nargs="+", default=["mixed_nvfp4", "fp8_block"])
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--size", default=SIZE, help="make-model --size (the proof uses the real geometry)")
    ap.add_argument("--quant-device", default="cuda", help="MOEFERRY_QUANT_DEVICE for make-model ('' = CPU)")
    ap.add_argument("--boot-timeout", type=float, default=150)
    ap.add_argument("--port", type=int, default=30210)
    ap.add_argument("--freetoken-arg", action="append", default=[], help="extra flag for freetoken (repeatable)")
    args = ap.parse_args()
    SIZE = args.size
    outdir, work = Path(args.out), Path(args.work)
    outdir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"presets": {}}

    def write_summary():
        summary["total_s"] = round(time.time() - T0, 1)
        (outdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    pending = None
    for i, preset in enumerate(args.presets):
        if pending is None:
            log(f"{preset}: make-model")
            pending = (preset, *start_make(preset, work, outdir, args.num_layers, args.quant_device), time.time())
        name, proc, logf, t_start = pending
        res = finish_make(name, proc, logf, work, outdir, args.num_layers, t_start)
        log(f"{preset}: make-model done {res}")
        summary["presets"][preset] = res
        write_summary()
        pending = None
        if i + 1 < len(args.presets):  # write the next checkpoint while this server boots
            nxt = args.presets[i + 1]
            log(f"{nxt}: make-model (background)")
            pending = (nxt, *start_make(nxt, work, outdir, args.num_layers, args.quant_device), time.time())
        if res["make_rc"] != 0:
            continue
        log(f"{preset}: starting freetoken")
        res["serve"] = serve(preset, work / preset, outdir, args.port + 10 * i, args.boot_timeout, args.freetoken_arg)
        chat = res["serve"].get("chat") or {}
        msg = ((chat.get("choices") or [{}])[0].get("message") or {})
        log(f"{preset}: booted={res['serve'].get('booted')} boot_s={res['serve'].get('boot_s')} "
            f"chat_status={res['serve'].get('chat_status')} reply={msg!r:.300}")
        write_summary()
        import shutil
        shutil.rmtree(work / preset, ignore_errors=True)  # disk for the next one
    write_summary()
    ok = all(p.get("serve", {}).get("chat_status") == 200 for p in summary["presets"].values())
    log(f"done: {'all answered' if ok else 'NOT all answered'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
