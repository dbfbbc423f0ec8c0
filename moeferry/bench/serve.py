"""`moeferry bench serve`: a load generator for any OpenAI-compatible server (ours, FreeToken, vLLM, SGLang).

Requests are streamed (so time to first token and the gaps between tokens are seen as a client
sees them) and sent at a request rate (Poisson arrivals; `inf` = all at once) and/or with at most
`--max-concurrency` in flight. Prompts are random token sequences of exactly `--input-len`
tokens (made with the model's tokenizer, so every engine gets the same prompts for a seed) or
lines of a file. The report gives request and token throughput and TTFT / TPOT / ITL / E2E
percentiles, as a table and as JSON.

TTFT: request sent -> first token. TPOT: (E2E - TTFT) / (output tokens - 1), per request.
ITL: every gap between streamed chunks carrying text. Output tokens come from the server's usage
(stream_options.include_usage); a server that sends none is counted by chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Result:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # None: tokens came but no text (random weights: held-back bytes)
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:1919",
                   help="server root; requests go to BASE/v1/... (default: http://127.0.0.1:1919)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (exact input lengths) or /v1/chat/completions (text through the chat "
                   "template) (default: completions)")
    g.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                   help="random /v1/completions prompts as text or as token-id lists; both are exactly "
                   "--input-len tokens (default: text: every OpenAI-compatible server takes it; FreeToken "
                   "0.1.2 refuses token ids)")
    g.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("MOEFERRY_API_KEY"),
                   help="sent as Authorization: Bearer (default: $OPENAI_API_KEY or $MOEFERRY_API_KEY)")
    g = p.add_argument_group("workload")
    g.add_argument("--tokenizer", metavar="DIR", help="model directory whose tokenizer.json makes the random "
                   "prompts (needed for random prompts)")
    g.add_argument("--prompts-file", metavar="FILE", help="prompts to send instead of random ones: a text "
                   "file (one prompt per line) or JSONL with a 'prompt' field; cycled to --num-prompts")
    g.add_argument("--num-prompts", type=int, default=64, help="requests to send (default: 64)")
    g.add_argument("--input-len", type=int, default=512, help="prompt tokens of random prompts (default: 512)")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens of every request (default: 128)")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS so every request "
                   "generates exactly --output-len tokens (vLLM/SGLang/moeferry extension)")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight (default: no limit)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    g = p.add_argument_group("report")
    g.add_argument("--percentiles", default="50,90,95,99", help="latency percentiles (default: 50,90,95,99)")
    g.add_argument("--result-json", metavar="FILE", help="also write the report (and each request) as JSON")
    g.add_argument("--label", help="a name for this run in the report (e.g. the engine)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")


# ---------------------------------------------------------------- prompts


class PromptMaker:
    """Random prompts of an exact token length that survive a decode/encode round trip, so their
    text is that many tokens to a server too. Drawn from the tokens that decode to whole
    characters (no U+FFFD from a split UTF-8 sequence) with no trailing whitespace."""

    def __init__(self, tokenizer_dir: str):
        from moeferry.text.tokenizer import Tokenizer

        self.tok = tok = Tokenizer.from_dir(tokenizer_dir)
        special = {tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
        pieces = ((i, tok.decode([i])) for i in range(min(tok.vocab_size, 200_000)) if i not in special)
        self.vocab = [i for i, p in pieces if p and "\ufffd" not in p and p == p.rstrip()]

    def ids(self, length: int, rng: random.Random) -> list[int]:
        for _ in range(100):
            ids = self.tok.encode(self.tok.decode([rng.choice(self.vocab) for _ in range(length + 16)]))[:length]
            if len(ids) == length and self.tok.encode(self.tok.decode(ids)) == ids:
                return ids
        raise SystemExit(f"bench serve: found no {length}-token prompt that round-trips through the tokenizer")

    def text(self, length: int, rng: random.Random) -> str:
        return self.tok.decode(self.ids(length, rng))


def random_prompts(tokenizer_dir: str, n: int, length: int, seed: int, as_text: bool) -> list:
    """n prompts of exactly `length` tokens (`PromptMaker`): texts, or token-id lists."""
    maker, rng = PromptMaker(tokenizer_dir), random.Random(seed)
    return [maker.text(length, rng) if as_text else maker.ids(length, rng) for _ in range(n)]


def file_prompts(path: str, n: int) -> list[str]:
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if path.endswith(".jsonl"):
        lines = [json.loads(line)["prompt"] for line in lines]
    if not lines:
        raise SystemExit(f"bench serve: {path} holds no prompts")
    return [lines[i % len(lines)] for i in range(n)]


# ---------------------------------------------------------------- requests


def _body(args, model: str, prompt) -> dict:
    body = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _has_text(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                or delta.get("tool_calls"))


async def one_request(client, url: str, body: dict, timeout: float) -> Result:
    res = Result()
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"].get("message", msg["error"]))
                    return res
                now = time.perf_counter()
                if any(_has_text(c) for c in msg.get("choices") or []):
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    # tokens whose text is empty (bytes of an unfinished character, often with random weights)
    # stream nothing: the request still completed; it counts in throughput, not in TTFT/TPOT/ITL
    res.ok = chunks > 0 or res.output_tokens > 0
    if not res.ok:
        res.error = "no tokens streamed"
    return res


async def _model_name(client, base: str) -> str:
    r = await client.get(base + "/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run(args, prompts: list) -> tuple[list[Result], float]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    url = base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    limits = httpx.Limits(max_connections=args.max_concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as client:
        model = args.model or await _model_name(client, base)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="requests", unit="req", file=sys.stderr)
        rng = np.random.default_rng(args.seed)

        async def send(prompt) -> Result:
            if gate is None:
                res = await one_request(client, url, _body(args, model, prompt), args.timeout)
            else:
                async with gate:
                    res = await one_request(client, url, _body(args, model, prompt), args.timeout)
            if bar is not None:
                bar.update(1)
            return res

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return list(results), duration


# ---------------------------------------------------------------- report


def _stats(values: list[float], percentiles: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{p:g}": None for p in percentiles}}
    a = np.asarray(values) * scale
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({f"p{p:g}": float(np.percentile(a, p)) for p in percentiles})
    return out


def summarize(results: list[Result], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    inp, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    timed = [r for r in ok if r.ttft is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in timed if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "input_tokens": inp, "output_tokens": out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out / duration if duration else 0.0,
        "total_token_throughput": (inp + out) / duration if duration else 0.0,
        "textless": len(ok) - len(timed),
        "ttft_ms": _stats([r.ttft for r in timed], percentiles), "tpot_ms": _stats(tpot, percentiles),
        "itl_ms": _stats([x for r in ok for x in r.itl], percentiles), "e2e_ms": _stats([r.e2e for r in ok],
                                                                                          percentiles),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def table(report: dict, title: str) -> str:
    rows = [("Successful requests", report["completed"]), ("Failed requests", report["failed"]),
            ("Requests streaming no text", report["textless"]),
            ("Benchmark duration (s)", f"{report['duration_s']:.2f}"),
            ("Total input tokens", report["input_tokens"]), ("Total output tokens", report["output_tokens"]),
            ("Request throughput (req/s)", f"{report['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{report['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{report['total_token_throughput']:.2f}")]
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        rows.append((f"-- {name} --", ""))
        for stat, value in report[key].items():
            rows.append((f"{stat.capitalize() if stat in ('mean', 'median', 'std') else stat.upper()} "
                         f"{key.split('_')[0].upper()} (ms)", "n/a" if value is None else f"{value:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    line = "=" * (width + 14)
    out = [line, f"{title:^{width + 14}}", line]
    out += [f"{k:<{width}}{v:>14}" if v != "" else f"{k:^{width + 14}}" for k, v in rows]
    for err in report["errors"]:
        out.append(f"error: {err}")
    return "\n".join(out + [line])


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1:
        print("bench serve: --num-prompts, --input-len and --output-len must be at least 1", file=sys.stderr)
        return 2
    if args.prompts_file:
        prompts: list = file_prompts(args.prompts_file, args.num_prompts)
    elif args.tokenizer:
        as_ids = args.endpoint == "completions" and args.prompt_format == "ids"
        prompts = random_prompts(args.tokenizer, args.num_prompts, args.input_len, args.seed, not as_ids)
    else:
        print("bench serve: random prompts need --tokenizer DIR (the model's directory); or give --prompts-file",
              file=sys.stderr)
        return 2
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    results, duration = asyncio.run(run(args, prompts))
    report = summarize(results, duration, percentiles)
    report["config"] = {k: ("inf" if v == float("inf") else v) for k, v in vars(args).items()
                        if k not in ("api_key", "command", "bench")}
    print(table(report, f"Serving Benchmark Result{' - ' + args.label if args.label else ''}"))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({**report, "requests": [asdict(r) for r in results]}, indent=2))
    return 0 if report["completed"] else 1
