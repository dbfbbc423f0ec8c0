"""`moeferry bench serve` against moeferry and FreeToken 0.1.2: same checkpoint, same flags, same
workload (issue 14). For each engine in turn: boot `serve --model DIR` with the shared `--flags`,
then run `moeferry bench serve` (random text prompts of exactly `--input-len` tokens, every
request `--output-len` tokens, `--max-concurrency` in flight) against it and keep its JSON.
Prints TTFT / TPOT / ITL percentiles and throughput side by side with the ratio.

    python benchmarks/bench_serve.py --model DIR --out OUT --flags "--max-running-requests 8"
    python benchmarks/bench_serve.py --model DEMO_DIR --out /tmp/b --flags "--moe-backend resident" \\
        --ours-args "--device cpu" --engines moeferry --num-prompts 4 --input-len 32 --output-len 8  # CPU wiring
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import REPO, common_arguments, compare, md_table, ratio, split_args  # noqa: E402

METRICS = [("completed", "completed", None), ("ttft_ms", "TTFT p50 ms", "p50"), ("ttft_ms", "TTFT p99 ms", "p99"),
           ("tpot_ms", "TPOT p50 ms", "p50"), ("itl_ms", "ITL p50 ms", "p50"),
           ("output_throughput", "output tok/s", None), ("request_throughput", "req/s", None)]


def scenario(args):
    def run(server) -> dict:
        out = Path(args.out) / f"bench_serve.{server.engine}.json"
        cmd = [sys.executable, "-m", "moeferry.cli", "bench", "serve", "--base-url", server.base, "--tokenizer",
               str(args.model), "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--ignore-eos", "--max-concurrency", str(args.max_concurrency),
               "--result-json", str(out), "--no-progress", "--label", server.engine]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.request_timeout)
        if not out.exists():
            return {"error": (done.stderr or done.stdout)[-500:]}
        report = json.loads(out.read_text())
        report.pop("requests", None)
        return {"report": report}
    return lambda prompts: run


def value(row: dict, key: str, sub: str | None):
    v = (row.get("report") or {}).get(key)
    return v.get(sub) if sub and isinstance(v, dict) else v


def render(info: dict, rows: list[dict]) -> str:
    head = (f"{info['date']}, {info.get('device') or info['machine']}; checkpoint {info['model']}; shared flags "
            f"`{info['flags']}`; {info['workload']}\n\n")
    table = [[r["engine"]] + [value(r, k, s) for k, _, s in METRICS] for r in rows]
    by = {r["engine"]: r for r in rows}
    if "moeferry" in by and "freetoken" in by:
        table.append(["ours / FreeToken"] + [ratio(value(by["moeferry"], k, s), value(by["freetoken"], k, s))
                                             for k, _, s in METRICS])
    return head + md_table(["engine"] + [name for _, name, _ in METRICS], table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap)
    ap.add_argument("--flags", default="", help="serve flags both engines get (one string)")
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-concurrency", type=int, default=8)
    args = ap.parse_args()
    workload = (f"{args.num_prompts} requests x {args.input_len} prompt tokens -> {args.output_len} tokens, "
                f"{args.max_concurrency} in flight")
    info = {"date": date.today().isoformat(), "machine": platform.node(), "model": str(args.model), "flags": args.flags,
            "workload": workload}

    def flags_of(i: int) -> list[str]:
        return ["--model", str(args.model), "--port", str(args.port + i), *split_args(args.flags)]

    rows = compare(args, "bench_serve", info, flags_of, scenario(args), render, h2d=False)
    return 0 if rows and all("report" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
