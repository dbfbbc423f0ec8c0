"""Shared pieces of the serving benchmarks (`offload.py`, `seed_scenario.py`).

- Engines: moeferry (`python -m moeferry.cli serve`) and FreeToken 0.1.2 (`python -m
  freetoken.cli serve`, which is `ft serve`), started with the same flags. FreeToken 0.1.2 names
  the chunk flag `--max-prefill-length` (ours takes both names) and has no `--gpu-memory-limit`
  (a run that needs it is skipped for FreeToken, with that reason).
- Processes: every server and the GPU ballast (`ballast.py`) run in their own process group
  (a new session) with their output in a log file; they are stopped by their PID (SIGTERM to
  the group, SIGKILL after 20 s). Every wait here has a deadline.
- Client: the standard library only (http.client), so nothing beyond the image is needed on
  the GPU machine. Prompts are texts of an exact token length sent to /v1/completions with
  `ignore_eos` (FreeToken 0.1.2 refuses token-id prompts), made from the checkpoint tokenizer's
  ordinary (non-special) ids with a different seed per prompt, so no prefix is shared.
- Measurements: time to first token of an N-token prompt (prefill), steady-state decode rate
  of B concurrent streams, and the expert-cache counters of moeferry's /v1/stats around the
  decode window (hits, misses, bytes fetched), from which the PCIe bound follows.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------- engines

ENGINES = ("moeferry", "freetoken")
FT_RENAMED = {"--max-extend-tokens": "--max-prefill-length"}  # FreeToken 0.1.2's names
FT_MISSING = ("--gpu-memory-limit",)  # flags FreeToken 0.1.2 does not have


class Unsupported(Exception):
    """This engine cannot run these flags (the reason is the message)."""


def freetoken_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("freetoken") is not None


def engine_argv(engine: str, flags: list[str], extra: list[str] = ()) -> list[str]:
    """The command line of `engine` serve with `flags` (ours' names) plus engine-only `extra`."""
    if engine == "moeferry":
        return [sys.executable, "-m", "moeferry.cli", "serve", *flags, *extra]
    if engine != "freetoken":
        raise ValueError(f"unknown engine {engine!r}")
    if not freetoken_installed():
        raise Unsupported("freetoken is not installed here")
    missing = [f for f in FT_MISSING if any(a == f or a.startswith(f + "=") for a in flags)]
    if missing:
        raise Unsupported(f"FreeToken 0.1.2 has no {', '.join(missing)}")
    renamed = [FT_RENAMED.get(a.split("=")[0], a.split("=")[0]) + a[len(a.split("=")[0]):] for a in flags]
    return [sys.executable, "-m", "freetoken.cli", "serve", *renamed, *extra]


def flag_value(flags: list[str], name: str, default: str | None = None) -> str | None:
    for i, a in enumerate(flags):
        if a == name and i + 1 < len(flags):
            return flags[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def split_args(text: str | None) -> list[str]:
    return shlex.split(text or "")


# -------------------------------------------------------------------------------- processes


class Managed:
    """A child process in its own session (process group = its PID), output to a log file."""

    def __init__(self, argv: list[str], log_path: Path, cwd: Path | str = REPO, env: dict | None = None):
        self.argv, self.log_path = argv, Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as f:
            f.write("$ " + shlex.join(argv) + "\n")
        self._log = open(self.log_path, "a")
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        self.started = time.time()
        self.proc = subprocess.Popen(argv, cwd=str(cwd), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.pid = self.proc.pid
        if os.environ.get("MOEFERRY_BENCH_PIDS"):  # the driver's list, to clean up after a hard kill
            with open(os.environ["MOEFERRY_BENCH_PIDS"], "a") as f:
                f.write(f"{self.pid}\n")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, grace_s: float = 20.0):
        """SIGTERM to the process group, SIGKILL after `grace_s`; the exit code (None if
        it would not die)."""
        if self.alive():
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:  # the leader is gone; children of its group may still hold the GPU
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.poll()


class Ballast(Managed):
    """`ballast.py`: holds all but `leave_gib` GiB of the GPU (and measures pinned H2D first)."""

    def __init__(self, leave_gib: float | None, log_path: Path, h2d: bool = True, timeout_s: float = 90.0):
        argv = [sys.executable, str(REPO / "benchmarks" / "ballast.py")]
        argv += [] if leave_gib is None else ["--leave-gib", str(leave_gib)]
        super().__init__(argv + (["--h2d"] if h2d else []), log_path)
        self.info = self._wait_report(timeout_s)

    def _wait_report(self, timeout_s: float) -> dict:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            m = re.search(r"^BALLAST (\{.*\})$", self.log_text(), re.M)
            if m:
                return json.loads(m.group(1))
            if not self.alive():
                return {"error": f"ballast exited {self.proc.returncode} without a report"}
            time.sleep(0.2)
        return {"error": f"no report within {timeout_s:.0f} s"}


def gpu_free_gib() -> float | None:
    """Free device memory as nvidia-smi reports it (no CUDA context in this process)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return int(out.stdout.split()[0]) * 2**20 / GIB if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def wait_gpu_free(min_gib: float, timeout_s: float = 40.0) -> float | None:
    """Wait until at least `min_gib` GiB are free (a stopped server's memory is back)."""
    deadline = time.time() + timeout_s
    free = gpu_free_gib()
    while free is not None and free < min_gib and time.time() < deadline:
        time.sleep(0.5)
        free = gpu_free_gib()
    return free


# ------------------------------------------------------------------------------ HTTP client


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, object]:
    """(status, parsed JSON or text); status 0 with the error text when nothing answered."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=data,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text
    except (OSError, http.client.HTTPException) as e:
        return 0, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


@dataclass
class Stream:
    """One streamed /v1/completions request, timed on this side."""
    ok: bool = False
    error: str | None = None
    t_send: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (with --enable-cache-report)

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    def tokens_after(self, t: float) -> float:
        """Tokens that arrived after time `t` (chunks scaled to the reported token count)."""
        n = len(self.chunk_times)
        per_chunk = (self.completion_tokens or n) / n if n else 0.0
        return per_chunk * sum(1 for c in self.chunk_times if c > t)

    def summary(self) -> dict:
        return {"ok": self.ok, "error": self.error, "ttft_s": _r(self.ttft_s),
                "total_s": _r(None if self.t_last is None else self.t_last - self.t_send),
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens}


def _r(x, nd=3):
    return None if x is None else round(x, nd)


def stream_completion(base: str, body: dict, timeout: float, on_first=None) -> Stream:
    """POST a streaming /v1/completions; `timeout` bounds every wait for bytes."""
    s = Stream()
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = dict(body, stream=True, stream_options={"include_usage": True})
    s.t_send = time.time()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            s.error = f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}"
            return s
        while True:
            line = resp.readline()
            if not line:
                s.error = s.error or "stream ended without [DONE]"
                return s
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                s.ok = s.error is None
                return s
            event = json.loads(data)
            if "error" in event:
                s.error = json.dumps(event["error"])[:500]
                continue
            now = time.time()
            if event.get("choices"):
                if s.t_first is None:
                    s.t_first = now
                    if on_first is not None:
                        on_first()
                s.t_last = now
                s.chunk_times.append(now)
            usage = event.get("usage")
            if usage:
                s.completion_tokens = usage.get("completion_tokens")
                s.prompt_tokens = usage.get("prompt_tokens")
                s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (OSError, http.client.HTTPException, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"
        return s
    finally:
        conn.close()


class Prompts:
    """Text prompts of an exact token length (by the checkpoint's tokenizer: `moeferry bench
    serve`'s `PromptMaker`), a different seed per prompt. Text, not token ids: FreeToken 0.1.2
    refuses token-id prompts ("OpenAI token-id prompt inputs are not supported"), and both
    engines must get the same input."""

    def __init__(self, model_dir: str | Path):
        from moeferry.bench.serve import PromptMaker

        self.maker = PromptMaker(str(model_dir))

    def text(self, n: int, seed: int) -> str:
        import random

        return self.maker.text(n, random.Random(seed))


# ------------------------------------------------------------------------------- servers


class Server(Managed):
    """A serving engine under test, its base URL, health and the JSON of its endpoints."""

    def __init__(self, engine: str, flags: list[str], log_path: Path, extra: list[str] = ()):
        self.engine = engine
        self.port = int(flag_value(flags, "--port", "1919"))
        self.base = f"http://127.0.0.1:{self.port}"
        cwd = REPO if engine == "moeferry" else "/tmp"  # FreeToken: nothing of ours in its cwd
        super().__init__(engine_argv(engine, flags, list(extra)), log_path, cwd=cwd)
        self.model_name: str | None = None

    def health(self, timeout: float = 5.0) -> tuple[int, object]:
        return http_json("GET", self.base + "/health", timeout=timeout)

    def get(self, path: str, timeout: float = 10.0):
        status, body = http_json("GET", self.base + path, timeout=timeout)
        return body if status == 200 else {"http_status": status, "body": body}

    def wait_ready(self, timeout_s: float) -> dict:
        """Poll /health until status ok: boot_s from the process start, or why it did not."""
        deadline = self.started + timeout_s
        last = None
        while time.time() < deadline:
            if not self.alive():
                return {"booted": False, "reason": f"exited with code {self.proc.returncode}",
                        "boot_s": _r(time.time() - self.started, 1), "last_health": last}
            status, body = self.health(timeout=3.0)
            if status:
                last = body
                state = body.get("status") if isinstance(body, dict) else None
                if state == "ok":
                    boot = time.time() - self.started
                    models = self.get("/v1/models")
                    data = models.get("data") if isinstance(models, dict) else None
                    self.model_name = data[0]["id"] if data else None
                    return {"booted": True, "boot_s": _r(boot, 1), "model_name": self.model_name}
                if state == "error":
                    return {"booted": False, "reason": f"health error: {body}", "boot_s": _r(time.time() - self.started, 1)}
            time.sleep(0.5)
        return {"booted": False, "reason": f"not ready within {timeout_s:.0f} s", "last_health": last}

    def healthy(self) -> dict:
        """Alive, /health status and restarts counter (moeferry) right now."""
        status, body = self.health(timeout=5.0)
        out = {"alive": self.alive(), "http": status}
        if isinstance(body, dict):
            out.update(status=body.get("status"), restarts=body.get("restarts"), worker_pid=body.get("worker_pid"))
        else:
            out["status"] = None
        return out

    def body(self, prompt: list[int], max_tokens: int) -> dict:
        return {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}

    def snapshot(self) -> dict:
        """Health, /v1/stats and /v1/cache/status at this moment."""
        return {"health": self.healthy(), "stats": self.get("/v1/stats"), "cache_status": self.get("/v1/cache/status")}


# --------------------------------------------------------------------------- measurements


def expert_counters(stats) -> dict | None:
    """hits, misses, bytes_fetched (totals) and slots from moeferry's /v1/stats `experts`;
    None when the server reports none (resident experts, or another engine)."""
    ex = stats.get("experts") if isinstance(stats, dict) else None
    if not isinstance(ex, dict):
        return None
    tot = ex.get("total") if isinstance(ex.get("total"), dict) else ex
    if tot.get("hits") is None:
        return None
    return {k: tot.get(k) for k in ("hits", "misses", "bytes_fetched")} | {"slots": ex.get("slots")}


def counter_delta(a: dict | None, b: dict | None, diff: bool = False) -> dict | None:
    """Counters from `a` to `b` (totals; `diff`: `a` and `b` are deltas already, of a shorter
    and a longer run) with the hit rate between them."""
    if not a or not b:
        return None
    d = {k: (b[k] or 0) - (a[k] or 0) for k in ("hits", "misses", "bytes_fetched")}
    if diff and min(d.values()) < 0:
        return None
    looked = d["hits"] + d["misses"]
    d["hit_rate"] = _r(d["hits"] / looked, 4) if looked else None
    return d


def prefill(server: Server, prompts: Prompts, n: int, seed: int, timeout: float) -> dict:
    """Time to first token of one prompt of exactly `n` tokens (max_tokens 1)."""
    s = stream_completion(server.base, server.body(prompts.text(n, seed), 1), timeout)
    out = s.summary()
    if s.ok and s.prompt_tokens not in (None, n):
        out["error"] = f"server counted {s.prompt_tokens} prompt tokens, sent {n}"
    return out


SHORT_TOKENS = 16  # the short run of the decode rate by difference
DECODE_PROMPT_TOKENS = 8  # the decode runs' prompts: one short prefill, the same in each run
STATS_SETTLE_S = 0.6  # moeferry's worker sends its counters every 0.25 s: read them after this (idle)


def decode(server: Server, prompts: Prompts, batch: int, out_tokens: int, seed: int, timeout: float,
           prompt_len: int = DECODE_PROMPT_TOKENS) -> dict:
    """Steady-state decode of `batch` concurrent streams of `out_tokens` (ignore_eos), measured
    by difference: two batches of SHORT_TOKENS, then two of `out_tokens`, each on new prompts of
    `prompt_len` tokens (short, so prefill, whose time varies with the expert cache's content,
    stays small); rate = batch x the extra tokens / the extra time to the last stream's end, the
    faster long batch over the faster short one (the first may compile; a one-off stall in one
    run would otherwise move the rate: FreeToken's b4 once read 229 tok/s from a stalled short
    run, its window rate 105).
    Prefill, first-token and detokenizer hold-back cancel out: a stream whose text is held back
    (random weights emit byte tokens that are not whole UTF-8 characters, for a while) or sent
    in a burst cannot look faster or slower than the engine decodes. The window rate of
    `stream_window` stays in the result (`window_tok_s`)."""
    shorts = [stream_window(server, prompts, batch, SHORT_TOKENS, seed + s, timeout, prompt_len) for s in (90, 50)]
    longs = [stream_window(server, prompts, batch, out_tokens, seed + s, timeout, prompt_len) for s in (0, 70)]
    short, out = _fastest(shorts), _fastest(longs)
    out["short_ends_s"], out["long_ends_s"] = [r.get("end_s") for r in shorts], [r.get("end_s") for r in longs]
    out["window_tok_s"] = out.pop("tok_s", None)
    if "error" in out or "error" in short:
        out.setdefault("error", short.get("error"))
        return out
    extra_s, extra_tokens = out["end_s"] - short["end_s"], batch * (out_tokens - SHORT_TOKENS)
    out["tok_s"] = _r(extra_tokens / extra_s, 2) if extra_s > 0 else None
    failed = [r.get("error") for r in shorts + longs if "error" in r]
    if failed:  # the difference of the two that ran is not trusted (FreeToken's b4 once read 190 tok/s from a
        # short run stalled for 5 s next to one that failed, its window rate 92): the window rate, marked
        out["tok_s"], out["rate_from"] = out["window_tok_s"], f"window ({len(failed)} of 4 runs failed: {failed[0]})"
    out["short_end_s"] = short["end_s"]
    out["window_experts"] = out.pop("experts", None)
    out.pop("bytes_per_token", None)
    extra = counter_delta(short.get("run_experts"), out.get("run_experts"), diff=True)
    if extra is not None:  # the expert traffic of the extra tokens (the two runs' counters subtracted)
        out["experts"] = extra
        out["bytes_per_token"] = round(extra["bytes_fetched"] / extra_tokens)
    return out


def _fastest(runs: list[dict]) -> dict:
    """The run that ended soonest (one that failed only if every run did)."""
    return min(runs, key=lambda r: float("inf") if "error" in r else r.get("end_s", float("inf")))


def stream_window(server: Server, prompts: Prompts, batch: int, out_tokens: int, seed: int, timeout: float,
                  prompt_len: int = 64) -> dict:
    """`batch` concurrent streams of `out_tokens` (ignore_eos), timed in a window.

    The window opens when every stream has its first token (moeferry's expert counters are
    read then) and closes when the last stream ends (read again): rate = tokens that arrived in
    the window / its length; bytes per token = bytes fetched in the window / those tokens;
    `end_s` = sent to the last stream's end."""
    all_first = threading.Event()
    lock = threading.Lock()
    firsts = [0]

    def first():
        with lock:
            firsts[0] += 1
            if firsts[0] == batch:
                all_first.set()

    results: list[Stream | None] = [None] * batch

    def run(i):
        results[i] = stream_completion(server.base, server.body(prompts.text(prompt_len, seed + i), out_tokens),
                                       timeout, on_first=first)
        if results[i].t_first is None:
            all_first.set()  # this stream failed before its first token: the window never opens

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(batch)]
    time.sleep(STATS_SETTLE_S)
    c_sent = expert_counters(server.get("/v1/stats"))
    for t in threads:
        t.start()
    opened = all_first.wait(timeout) and firsts[0] == batch
    t0 = time.time()
    c0 = expert_counters(server.get("/v1/stats")) if opened else None
    deadline = time.time() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    time.sleep(STATS_SETTLE_S)
    c1 = expert_counters(server.get("/v1/stats"))
    streams = [r for r in results if r is not None]
    out = {"batch": batch, "out_tokens": out_tokens, "streams": [s.summary() for s in streams],
           "run_experts": counter_delta(c_sent, c1)}
    if len(streams) < batch or not all(s.ok for s in streams) or not opened:
        out["error"] = next((s.error for s in streams if s.error), None) or "streams did not finish in time"
        return out
    t_end = max(s.t_last for s in streams)
    tokens = sum(s.tokens_after(t0) for s in streams)
    out["window_s"] = _r(t_end - t0)
    out["tok_s"] = _r(tokens / (t_end - t0), 2) if t_end > t0 and tokens else None
    # end to end (sent -> last token): a server that holds tokens back and sends them in a burst
    # (FreeToken 0.1.2's seed decode: first token at 3.7 s, 63 more within 0.19 s) looks fast in the window
    slowest = max(s.t_last - s.t_send for s in streams)
    out["end_s"] = _r(slowest)
    out["e2e_tok_s"] = _r(sum(s.completion_tokens or 0 for s in streams) / slowest, 2) if slowest > 0 else None
    delta = counter_delta(c0, c1)
    if delta is not None:
        out["experts"] = delta
        out["bytes_per_token"] = round(delta["bytes_fetched"] / tokens) if tokens else None
    return out


def pcie_bound(bytes_per_token: float | None, h2d_bytes_per_s: float | None) -> float | None:
    """Decode tok/s if the fetched expert bytes were the only cost (PCIe at the measured rate)."""
    if bytes_per_token is None or not h2d_bytes_per_s:
        return None
    return float("inf") if bytes_per_token == 0 else h2d_bytes_per_s / bytes_per_token


def freetoken_slots(log_text: str, cache_status) -> int | None:
    """FreeToken's expert slots: /v1/cache/status geometry, else its '--moe-cache-auto resolved' log line."""
    geo = cache_status.get("geometry") if isinstance(cache_status, dict) else None
    if isinstance(geo, dict) and geo.get("moe_cache_size"):
        return int(geo["moe_cache_size"])
    found = re.findall(r"moe_cache_size=(\d+)", log_text)
    return int(found[-1]) if found else None


def moeferry_slots(cache_status, stats) -> int | None:
    """moeferry's expert slots: /v1/cache/status (its plan, its engine section or top level),
    else /v1/stats experts.slots."""
    docs = [cache_status] if isinstance(cache_status, dict) else []
    docs += [cache_status.get(k) for k in ("plan", "engine")] if docs else []
    for doc in docs:
        if isinstance(doc, dict) and isinstance(doc.get("expert_slots"), int):
            return doc["expert_slots"]
    counters = expert_counters(stats)
    return counters.get("slots") if counters else None


def run_engine(engine: str, flags: list[str], extra: list[str], out_dir: Path, tag: str, boot_timeout: float,
               scenario, min_free_gib: float | None = None) -> dict:
    """Boot `engine` with `flags`, run `scenario(server) -> dict` if it booted, snapshot its
    endpoints, stop it. Never raises for the engine's own failures: they are the result."""
    res: dict = {"engine": engine, "flags": shlex.join(flags), "extra": shlex.join(extra)}
    if min_free_gib is not None:
        res["gpu_free_gib_at_start"] = _r(wait_gpu_free(min_free_gib), 2)
    try:
        server = Server(engine, flags, out_dir / f"{tag}.{engine}.log", extra)
    except Unsupported as e:
        res["skipped"] = str(e)
        log(f"{engine}: skipped ({e})")
        return res
    log(f"{engine}: started pid {server.pid}: {shlex.join(server.argv)}")
    try:
        res.update(server.wait_ready(boot_timeout))
        boot_log = len(server.log_text())  # what the log held at ready: boot's out-of-memory errors are apart
        log(f"{engine}: booted={res['booted']} in {res.get('boot_s')} s {res.get('reason', '')}")
        if res["booted"]:
            res["boot_cache_status"] = server.get("/v1/cache/status")  # the plan, before any step ran
            try:
                res.update(scenario(server))
            except Exception as e:  # a client-side bug must not leave the server running
                res["scenario_error"] = f"{type(e).__name__}: {e}"
                log(f"{engine}: scenario error {res['scenario_error']}")
        res["final"] = server.snapshot() if server.alive() else {"health": {"alive": False}}
        text = server.log_text()
        for key, doc in (("expert_slots_boot", res.get("boot_cache_status")),
                         ("expert_slots", res["final"].get("cache_status") or res.get("boot_cache_status"))):
            res[key] = (freetoken_slots(text, doc) if engine == "freetoken"
                        else moeferry_slots(doc, res["final"].get("stats")))
        oom = re.compile(r"out of memory|OutOfMemoryError", re.I)
        res["oom_in_log"] = bool(oom.search(text))
        res["oom_at_boot"] = bool(oom.search(text[:boot_log]))  # moeferry's boot self-test shrinks on them
        res["oom_serving"] = bool(oom.search(text[boot_log:]))
        res["log_notes"] = re.findall(r"^.*(?:decode CUDA graphs|CUDA graphs off|expert fetches|warm-up took).*$",
                                      text, re.M)[:8]  # how the engine decided to run decode
    finally:
        res["alive_at_end"] = server.alive()
        res["exit_code"] = server.stop()
        log(f"{engine}: stopped (alive at end: {res['alive_at_end']}, exit {res['exit_code']})")
    return res


# -------------------------------------------------------------------------------- results


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return "inf" if x == float("inf") else f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def ratio(a, b) -> float | None:
    return None if a is None or not b or a == float("inf") or b == float("inf") else a / b


def save(out_dir: Path, name: str, result: dict, table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / f"{name}.md").write_text(table)


def common_arguments(ap) -> None:
    """Flags both benchmark scripts take."""
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--out", required=True, help="results and logs go here")
    ap.add_argument("--leave-gib", type=float, default=None,
                    help="start a ballast leaving this much GPU memory free (omit: no ballast)")
    ap.add_argument("--engines", default="moeferry,freetoken", help="comma-separated (default: both)")
    ap.add_argument("--ours-args", default="", help="extra flags for moeferry only (one string)")
    ap.add_argument("--ft-args", default="", help="extra flags for FreeToken only (one string)")
    ap.add_argument("--boot-timeout", type=float, default=240.0, help="seconds for a server to be ready")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds any one request may wait")
    ap.add_argument("--engine-budget", type=float, default=180.0,
                    help="seconds of measurements per engine after boot; later ones are skipped")


class Budget:
    """A deadline for one engine's measurements: `left()` seconds, `over()` when spent."""

    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.time())

    def over(self) -> bool:
        return time.time() >= self.end


def start_ballast(leave_gib: float | None, out_dir: Path, h2d: bool) -> tuple[Ballast | None, dict]:
    """The ballast and its report (with the H2D bandwidths if `h2d`); (None, report) when no ballast
    was asked (the H2D measurement alone) or there is no CUDA (the report says so)."""
    if leave_gib is None and not h2d:
        return None, {}
    b = Ballast(leave_gib, out_dir / "ballast.log", h2d=h2d)
    info = b.info
    log(f"ballast: {info}")
    if leave_gib is None or "error" in info:
        b.stop()
        return None, info
    return b, info


def ballast_note(info: dict) -> str:
    free = info.get("free_gib")
    return "no ballast" if free is None else f"ballast left {free} GiB free (of {info['ballast'].get('total_gib')})"


def engines_to_run(text: str) -> list[str]:
    names = [e for e in text.split(",") if e]
    bad = [e for e in names if e not in ENGINES]
    if bad:
        raise SystemExit(f"unknown engine(s) {bad}; choose from {ENGINES}")
    return names


def _exit_on_sigterm() -> None:
    """SIGTERM (a `timeout` around the script) exits through the finally blocks, so the servers
    and the ballast are stopped rather than left holding the GPU."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def compare(args, name: str, info: dict, flags_of, make_scenario, render, h2d: bool, after=None) -> list[dict]:
    """The shared frame of both benchmarks: the ballast (and the H2D measurement if `h2d`),
    then each engine of `--engines` in turn: `run_engine` with `flags_of(index)`, the
    engine-only extra flags and `make_scenario(prompts)`; `after(row, info)` adds derived
    numbers; results are saved after every engine and the table printed at the end."""
    _exit_on_sigterm()
    out = Path(args.out)
    ballast, binfo = start_ballast(args.leave_gib, out, h2d)
    info.update(ballast=binfo, device=binfo.get("device"), free_gib=binfo.get("free_gib"))
    rows: list[dict] = []
    try:
        if args.leave_gib is not None and ballast is None:
            raise SystemExit(f"ballast failed: {binfo}")
        prompts = Prompts(args.model)
        for i, engine in enumerate(engines_to_run(args.engines)):
            extra = split_args(args.ours_args if engine == "moeferry" else args.ft_args)
            min_free = None if ballast is None else binfo["free_gib"] - 0.5
            row = run_engine(engine, flags_of(i), extra, out, name, args.boot_timeout, make_scenario(prompts),
                             min_free_gib=min_free)
            if after is not None:
                after(row, info)
            rows.append(row)
            save(out, name, {"info": info, "rows": rows}, render(info, rows))
    finally:
        if ballast is not None:
            ballast.stop()
    table = render(info, rows)
    save(out, name, {"info": info, "rows": rows}, table)
    print(table, flush=True)
    return rows
