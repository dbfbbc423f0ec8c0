"""The seed scenario (issue 12): the user's command line, a small card, long prompts. Does the
server survive, and how many expert slots did it dare?

For each engine (moeferry, then FreeToken 0.1.2), with a GPU ballast leaving `--leave-gib` GiB
free (the seed's card had 14.59 GiB): start

    ft serve --model DIR --served-model-name x --host 0.0.0.0 --port 1919 --moe-backend offload
      --moe-cache-auto --kv-reserve-tokens 131072 --max-seq-len-override 131072
      --max-running-requests 1 --max-output-tokens 4096 --sampling-defaults model --enable-cache-report

verbatim (`--base-flags`), plus `--extra-flags` (e.g. `--max-extend-tokens 32768`, which
FreeToken 0.1.2 gets as `--max-prefill-length 32768`; a repeated flag overrides the base one),
then send `--prompts` prompts of exactly `--prompt-tokens` tokens (texts, to
/v1/completions, `--max-tokens` each), `--concurrency` at a time. Per prompt: completed or the
error, time to first token and total, and /health after it (alive, status, restarts, worker
pid). A failed prompt is followed by up to 60 s of waiting for /health ok; a server that does
not come back gets no more prompts. Then /v1/cache/status (the memory plan; FreeToken's
geometry), /v1/stats (expert slots, cache shrinks) and a batch-1 decode of `--decode-tokens`.
FreeToken's slots come from its /v1/cache/status or its "--moe-cache-auto resolved" log line.
With `--agent-turns K`, before the decode: K turns of one growing conversation (an agent's
pattern: each turn is the last turn's prompt plus `--turn-tokens` new tokens), each timed to its
first token with the tokens the server reports as served from its prefix cache.

Prints a table (plus moeferry's plan table) and writes `<name>.json`, `<name>.md`, the
ballast log and each server's log to --out.

    python benchmarks/seed_scenario.py --model DIR --out OUT --leave-gib 14.6        # 8 x 8192, one at a time
    python benchmarks/seed_scenario.py --model DIR --out OUT --leave-gib 14.6 --name seed_c4 \\
        --extra-flags "--max-running-requests 4" --concurrency 4 --prompts 4
    python benchmarks/seed_scenario.py --model DEMO_DIR --out /tmp/s --engines moeferry --host 127.0.0.1 \\
        --base-flags "--moe-backend resident" --ours-args "--device cpu" --prompts 3 --prompt-tokens 64
"""
from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import threading
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import (  # noqa: E402
    Budget, Prompts, ballast_note, common_arguments, compare, decode, log, md_table, split_args, stream_completion,
)

SEED_FLAGS = ("--served-model-name x --host 0.0.0.0 --port 1919 --moe-backend offload --moe-cache-auto "
              "--kv-reserve-tokens 131072 --max-seq-len-override 131072 --max-running-requests 1 "
              "--max-output-tokens 4096 --sampling-defaults model --enable-cache-report")


def send_wave(server, prompts: Prompts, seeds: list[int], n_tokens: int, max_tokens: int, timeout: float) -> list:
    """Send one prompt per seed at once; the per-prompt records."""
    out: list = [None] * len(seeds)

    def one(i):
        s = stream_completion(server.base, server.body(prompts.text(n_tokens, seeds[i]), max_tokens), timeout)
        out[i] = s.summary()
        if s.ok and s.prompt_tokens not in (None, n_tokens):
            out[i]["error"] = f"server counted {s.prompt_tokens} prompt tokens, sent {n_tokens}"
            out[i]["ok"] = False

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return [r or {"ok": False, "error": "client thread did not finish"} for r in out]


def wait_healthy(server, seconds: float) -> dict:
    end = time.time() + seconds
    h = server.healthy()
    while h.get("status") != "ok" and server.alive() and time.time() < end:
        time.sleep(1.0)
        h = server.healthy()
    return h


def scenario(args, prompts: Prompts, budget_s: float):
    def run(server) -> dict:
        budget = Budget(budget_s)
        records, start = [], server.healthy()
        sent = 0
        down = None
        while sent < args.prompts:
            if budget.over():
                down = "engine budget spent"
                break
            wave = list(range(sent, min(args.prompts, sent + args.concurrency)))
            results = send_wave(server, prompts, [40_000 + i for i in wave], args.prompt_tokens, args.max_tokens,
                                min(args.request_timeout, budget.left() + 1))
            health = server.healthy()
            for i, r in zip(wave, results):
                records.append({"prompt": i, **r, "health_after": health})
                log(f"{server.engine}: prompt {i}: ok={r['ok']} ttft={r.get('ttft_s')} err={r.get('error')} "
                    f"health={health}")
            sent += len(wave)
            if not all(r["ok"] for r in results):
                health = wait_healthy(server, min(60.0, budget.left()))
                if health.get("status") != "ok":
                    down = f"unhealthy after a failed prompt: {health}"
                    break
        for i in range(sent, args.prompts):
            records.append({"prompt": i, "ok": False, "error": f"not sent: {down}"})
        end = server.healthy()
        out = {"prompts": records, "health_start": start, "health_end": end,
               "completed": sum(1 for r in records if r["ok"]), "stopped_sending": down}
        if start.get("restarts") is not None and end.get("restarts") is not None:
            out["restarts"] = end["restarts"] - start["restarts"]
        out["worker_changed"] = start.get("worker_pid") != end.get("worker_pid") if start.get("worker_pid") else None
        if args.agent_turns and end.get("status") == "ok":
            out["agent_turns"] = agent_turns(server, prompts, args, budget)
        if end.get("status") == "ok" and not budget.over():
            out["decode"] = decode(server, prompts, 1, args.decode_tokens, seed=50_000,
                                   timeout=min(args.request_timeout, budget.left() + 1))
        return out
    return run


def agent_turns(server, prompts: Prompts, args, budget: Budget) -> list[dict]:
    """The turns of one conversation that grows by `turn_tokens` new tokens a turn."""
    text, turns = prompts.text(args.prompt_tokens, 60_000), []
    for k in range(args.agent_turns):
        if budget.over():
            break
        s = stream_completion(server.base, server.body(text, args.max_tokens), min(args.request_timeout,
                                                                                     budget.left() + 1))
        turns.append({"turn": k, **s.summary()})
        log(f"{server.engine}: agent turn {k}: ttft={s.ttft_s} prompt={s.prompt_tokens} cached={s.cached_tokens} "
            f"err={s.error}")
        text += prompts.text(args.turn_tokens, 60_001 + k)
    return turns


def render_turns(rows: list[dict]) -> str:
    """Per engine and turn: time to first token, prompt and cached tokens."""
    table = [[r["engine"], t["turn"], t.get("ttft_s"), t.get("prompt_tokens"), t.get("cached_tokens"),
              (t.get("error") or "")[:80] or None]
             for r in rows for t in r.get("agent_turns") or []]
    if not table:
        return ""
    return "\nAgent turns (one conversation, each turn the last one's prompt plus new tokens):\n\n" + md_table(
        ["engine", "turn", "TTFT s", "prompt tokens", "cached tokens (reported)", "error"], table)


def render(info: dict, rows: list[dict]) -> str:
    head = (f"{info['date']}, {info.get('device') or info['machine']}; checkpoint {info['model']}; "
            f"{ballast_note(info)}; {info['prompts']} prompts x "
            f"{info['prompt_tokens']} tokens, {info['concurrency']} at a time\n\n`{info['flags']}`\n\n")
    headers = ["engine", "boot s", "expert slots", "completed", "restarts", "survived", "OOM at boot / serving",
               "TTFT median s", "decode tok/s after (by difference)", "decode end to end tok/s", "first error"]
    table = []
    for r in rows:
        if r.get("skipped"):
            table.append([r["engine"], f"skipped: {r['skipped']}"] + [None] * (len(headers) - 2))
            continue
        recs = r.get("prompts") or []
        ttfts = [p["ttft_s"] for p in recs if p.get("ok") and p.get("ttft_s") is not None]
        err = next((p.get("error") for p in recs if p.get("error")), r.get("reason") or r.get("scenario_error"))
        survived = bool(r.get("booted") and r.get("alive_at_end") and (r.get("health_end") or {}).get("status") == "ok"
                        and not r.get("restarts"))
        table.append([r["engine"], r.get("boot_s") if r.get("booted") else f"failed ({r.get('boot_s')} s)",
                      r.get("expert_slots"), f"{r.get('completed', 0)}/{info['prompts']}", r.get("restarts"),
                      "yes" if survived else "NO",
                      " / ".join("yes" if r.get(k) else "no" for k in ("oom_at_boot", "oom_serving")),
                      statistics.median(ttfts) if ttfts else None, (r.get("decode") or {}).get("tok_s"),
                      (r.get("decode") or {}).get("e2e_tok_s"),
                      (err or "")[:160].replace("|", "/") or None])
    text = head + md_table(headers, table) + render_turns(rows)
    for r in rows:  # moeferry's memory plan as it printed it at boot
        plan = ((r.get("final") or {}).get("cache_status") or {}).get("plan_table")
        if plan:
            text += f"\n{r['engine']} memory plan:\n```\n{plan}\n```\n"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap)
    ap.add_argument("--name", default="seed", help="result file names (default: seed)")
    ap.add_argument("--base-flags", default=SEED_FLAGS, help="the seed's flags after --model DIR (default: verbatim)")
    ap.add_argument("--extra-flags", default="", help="flags appended for both engines (one string)")
    ap.add_argument("--host", default=None, help="replace the --host of the base flags (e.g. 127.0.0.1 for tests)")
    ap.add_argument("--port", type=int, default=None, help="replace the --port of the base flags")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per prompt")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens of the decode measurement after")
    ap.add_argument("--agent-turns", type=int, default=0, help="turns of one growing conversation (default: none)")
    ap.add_argument("--turn-tokens", type=int, default=256, help="new tokens a turn adds (default: 256)")
    args = ap.parse_args()
    flags = ["--model", str(args.model), *split_args(args.base_flags), *split_args(args.extra_flags)]
    for name, value in (("--host", args.host), ("--port", args.port)):
        if value is not None:
            flags = [a for i, a in enumerate(flags) if a != name and (i == 0 or flags[i - 1] != name)]
            flags += [name, str(value)]
    info = {"date": date.today().isoformat(), "machine": platform.node(), "model": str(args.model),
            "flags": shlex.join(flags), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
            "concurrency": args.concurrency}
    rows = compare(args, args.name, info, lambda i: flags, lambda prompts: scenario(args, prompts, args.engine_budget),
                   render, h2d=False)
    ours = next((r for r in rows if r["engine"] == "moeferry"), None)
    return 0 if ours is None or ours.get("completed") == args.prompts else 1

if __name__ == "__main__":
    sys.exit(main())
