"""Expert offload, moeferry against FreeToken 0.1.2: same checkpoint, same flags, same ballast.

For each engine (one after the other, the GPU ballast held throughout): start `serve` with
`--model DIR` and the shared `--flags` (e.g. `--moe-backend offload --moe-cache-size 3600`),
wait for /health, then measure

- boot: process start to /health ok;
- prefill: time to first token of a prompt of exactly `--prefill` tokens (a text, to
  /v1/completions, max_tokens 1), run twice (the first can compile kernels), the faster kept;
- decode: `--out-tokens` streamed tokens (ignore_eos) at batch 1 and batch 4 (concurrent
  streams), by difference against the same batch of 16 tokens (`serving.decode`: prefill,
  first token and streams held back or sent in bursts cancel out); the window rate between
  "every stream has its first token" and the last token is in the JSON (`window_tok_s`);
- moeferry's expert-cache hit rate and bytes fetched for those extra tokens (/v1/stats
  `experts`), and from them the PCIe bound: bytes fetched per token over the pinned
  host->device bandwidth that the ballast process measured on this card in the same run
  (64 MiB copies; the 2 MiB figure, about one expert per copy, is in the JSON). FreeToken 0.1.2
  serves no expert counters, so its hit rate is not shown.

First, the same request (37-token prompt, 16 tokens) three times: the first after ready against
the third (issue 13: within 1.5x; kernels compiled at boot, not on first use); it also warms up. Prints a markdown
table and writes `offload.json`, `offload.md`, `ballast.log` and each server's log to --out.

    python benchmarks/offload.py --model DIR --out OUT --leave-gib 14.6 \\
        --flags "--moe-backend offload --moe-cache-size 3600 --max-running-requests 4 --max-seq-len-override 32768"
    python benchmarks/offload.py --model DEMO_DIR --out /tmp/o --flags "--moe-backend resident" \\
        --ours-args "--device cpu" --engines moeferry --prefill 64 --out-tokens 16    # CPU wiring check
"""
from __future__ import annotations

import argparse
import platform
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import (  # noqa: E402
    Budget, Prompts, ballast_note, common_arguments, compare, decode, log, md_table, pcie_bound, prefill, ratio,
    split_args, stream_window,
)

BIG_COPY = str(64 * 2**20)
FIRST_PROMPT_TOKENS = 37


def scenario(args, prompts: Prompts, budget_s: float):
    """The measurements on one booted server (skipped once the engine's budget is spent)."""
    def run(server) -> dict:
        budget = Budget(budget_s)
        t = min(args.request_timeout, budget.left())
        # 37 tokens: a length no warm-up chunk has, in a bucket of its own (the H200 once compiled on
        # the first 8-token prompt while 64-token ones were warm)
        first = [stream_window(server, prompts, 1, 16, seed=10_000, timeout=t, prompt_len=FIRST_PROMPT_TOKENS)
                 for _ in range(3)]
        totals = [(r.get("streams") or [{}])[0].get("total_s") for r in first]
        out: dict = {"first_requests_s": totals, "first_vs_third": ratio(totals[0], totals[2])}
        runs = []
        for i in range(2):
            if budget.over():
                break
            runs.append(prefill(server, prompts, args.prefill, seed=20_000 + i,
                                timeout=min(args.request_timeout, budget.left())))
            log(f"{server.engine}: prefill {args.prefill}: {runs[-1]}")
        out["prefill_runs"] = runs
        good = [r["ttft_s"] for r in runs if r["ok"] and not r.get("error")]
        out["prefill_s"] = min(good) if good else None
        for batch in (1, 4):
            if budget.over():
                out[f"decode_b{batch}"] = {"error": "skipped: engine budget spent"}
                continue
            d = decode(server, prompts, batch, args.out_tokens, seed=30_000 + 100 * batch,
                       timeout=min(args.request_timeout, budget.left()))
            out[f"decode_b{batch}"] = d
            log(f"{server.engine}: decode b{batch}: {d.get('tok_s')} tok/s experts {d.get('experts')} "
                f"{d.get('error') or ''}{d.get('rate_from') or ''}")
        return out
    return run


def _rate(decode: dict):
    """A decode rate for the table, marked when it is the window rate (some runs of the difference failed)."""
    return f"{decode['tok_s']} (window)" if decode.get("rate_from") and decode.get("tok_s") else decode.get("tok_s")


def render(info: dict, rows: list[dict], prefill_n: int) -> str:
    bw = (info.get("ballast") or {}).get("h2d_bytes_per_s") or {}
    head = (f"{info['date']}, {info.get('device') or info['machine']}; checkpoint {info['model']}; "
            f"shared flags `{info['flags']}`; {ballast_note(info)}; pinned H2D "
            + ", ".join(f"{int(k) // 2**20} MiB copies {v / 1e9:.1f} GB/s" for k, v in bw.items()) + "\n\n")
    headers = ["engine", "boot s", "1st / 3rd request", f"prefill {prefill_n} s", "decode b1 tok/s", "decode b4 tok/s",
               "end to end b1 / b4 tok/s", "hit rate b1",
               "hit rate b4", "PCIe bound b1 tok/s", "b1 / bound", "PCIe bound b4 tok/s"]
    table = []
    for r in rows:
        if r.get("skipped"):
            table.append([r["engine"], f"skipped: {r['skipped']}"] + [None] * (len(headers) - 2))
            continue
        b1, b4 = r.get("decode_b1") or {}, r.get("decode_b4") or {}
        boot = r.get("boot_s") if r.get("booted") else f"failed: {r.get('reason')}"
        table.append([r["engine"], boot, r.get("first_vs_third"), r.get("prefill_s"), _rate(b1), _rate(b4),
                      _pair(b1.get("e2e_tok_s"), b4.get("e2e_tok_s")), (b1.get("experts") or {}).get("hit_rate"),
                      (b4.get("experts") or {}).get("hit_rate"),
                      r.get("bound_b1"), ratio(b1.get("tok_s"), r.get("bound_b1")), r.get("bound_b4")])
    by = {r["engine"]: r for r in rows}
    if "moeferry" in by and "freetoken" in by:
        ours, ft = by["moeferry"], by["freetoken"]

        def get(r, *path):
            for p in path:
                r = (r or {}).get(p)
            return r
        boots = [r["boot_s"] if r.get("booted") else None for r in (ours, ft)]
        table.append(["ours / FreeToken", ratio(*boots), None,
                      ratio(ours.get("prefill_s"), ft.get("prefill_s")),
                      ratio(get(ours, "decode_b1", "tok_s"), get(ft, "decode_b1", "tok_s")),
                      ratio(get(ours, "decode_b4", "tok_s"), get(ft, "decode_b4", "tok_s")),
                      _pair(ratio(get(ours, "decode_b1", "e2e_tok_s"), get(ft, "decode_b1", "e2e_tok_s")),
                            ratio(get(ours, "decode_b4", "e2e_tok_s"), get(ft, "decode_b4", "e2e_tok_s")))]
                     + [None] * (len(headers) - 7))
    targets = ("Targets (issue 11): decode >= 1.5x FreeToken at equal slots and >= 0.8 of the PCIe bound; "
               "prefill time <= FreeToken's; boot <= 0.5x FreeToken's." if "--moe-cache" in info["flags"] else
               "Targets (issue 13, experts on the device): decode b1 >= 1.5x FreeToken's (mixed_nvfp4) or 1.2x "
               "(bf16); prefill ahead; the first request after ready within 1.5x of the third.")
    notes = f"\n{targets} Ratios: time ratios for boot and prefill (lower is better), rate ratios for decode.\n"
    return head + md_table(headers, table) + notes


def _pair(a, b) -> str:
    """Two numbers as the table's cell "a / b" (two decimals, "-" for a missing one)."""
    return " / ".join("-" if x is None else f"{x:.2f}" for x in (a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap)
    ap.add_argument("--flags", required=True, help="serve flags both engines get (one string)")
    ap.add_argument("--port", type=int, default=30300, help="first port (each engine gets the next one)")
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the prefill measurement")
    ap.add_argument("--out-tokens", type=int, default=256, help="tokens per stream in the decode measurements")
    args = ap.parse_args()
    flags = split_args(args.flags)
    info = {"date": date.today().isoformat(), "machine": platform.node(), "model": str(args.model),
            "flags": args.flags, "prefill_tokens": args.prefill, "out_tokens": args.out_tokens}

    def flags_of(i: int) -> list[str]:
        return ["--model", str(args.model), "--port", str(args.port + i), *flags]

    def bounds(row: dict, info: dict) -> None:
        h2d = ((info.get("ballast") or {}).get("h2d_bytes_per_s") or {}).get(BIG_COPY)
        for b in (1, 4):
            row[f"bound_b{b}"] = pcie_bound((row.get(f"decode_b{b}") or {}).get("bytes_per_token"), h2d)

    rows = compare(args, "offload", info, flags_of, lambda prompts: scenario(args, prompts, args.engine_budget),
                   lambda info, rows: render(info, rows, args.prefill), h2d=True, after=bounds)
    return 0 if rows and all(r.get("booted") or r.get("skipped") for r in rows) else 1

if __name__ == "__main__":
    sys.exit(main())
