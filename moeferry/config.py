"""ServeConfig: every `serve` flag, validated once, resolved once, frozen.

`add_serve_arguments` declares the flags (their help is the reference), `ServeConfig.from_args`
turns a parsed namespace into the one config object the server uses. Flags whose feature is
not built yet are listed in `NOT_BUILT` (the single table of them) and refused with the issue
that will add them; FreeToken flags with no moeferry meaning are refused with the reason
(`moeferry/freetoken_flags.py`); nothing is accepted and ignored.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moeferry.engine.config import CACHE_POLICIES, EXPERT_LOADS, MOE_BACKENDS, EngineConfig, EngineSizes, derive_sizes
from moeferry.freetoken_flags import add_freetoken_arguments, our_value, refused_freetoken_flags, their_values
from moeferry.text.reasoning import REASONING_PARSERS
from moeferry.text.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919
DEMO_MODEL_NAME = "moeferry-demo-random-weights"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """The command line asks for something invalid or not built yet."""


@dataclass(frozen=True)
class NotBuilt:
    flag: str  # as the user writes it
    given: Callable[[argparse.Namespace], bool]
    comes_with: str  # the issue that will build it, in words


# The one table of flags that parse but whose feature is not built yet (none at the moment:
# a new flag whose feature is not finished goes here, and is refused with the issue that adds it).
NOT_BUILT: tuple[NotBuilt, ...] = ()


def not_built_flags(args: argparse.Namespace) -> list[NotBuilt]:
    return [n for n in NOT_BUILT if n.given(args)]


# ---------------------------------------------------------------- argument types

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'16GiB' -> 17179869184; '500MB' -> 500000000; a plain number is bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (write e.g. 16GiB, 500MB or a byte count)")
    return int(float(m.group(1)) * _UNITS[unit])


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"'{text}' is not a device (auto, cpu, cuda or cuda:N)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "--model-path", dest="model", metavar="DIR",
                   help="Hugging Face model directory (config.json, safetensors, tokenizer). Without it the "
                   "built-in random-weight demo model is made in the user cache directory on first use and served.")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="model id clients send and /v1/models lists (default: the model directory's name; the "
                   "demo: moeferry-demo-random-weights)")
    g.add_argument("--device", type=_device, default="auto", help="auto (cuda if available, else cpu), cpu, cuda, "
                   "cuda:N (default: auto)")
    g.add_argument("--tensor-parallel-size", "--tp-size", type=_positive_int, default=1, metavar="N",
                   help="GPUs one model is split over: 1 (moeferry serves a model from one GPU; default: 1)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weight and activation dtype; auto = bfloat16 on cuda, float32 on cpu (default: auto)")

    g = p.add_argument_group("http")
    g.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})")
    g.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port to listen on (default: {DEFAULT_PORT})")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log verbosity (default: info)")
    g.add_argument("--worker-stall-timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
                   help="an engine worker that makes no progress this long while it has requests is killed, "
                   "its requests fail with an error saying so, and a new worker starts; /health reports it "
                   "as stalled after min(5, SECONDS/2) s. Must exceed the longest single step (default: 60)")

    g = p.add_argument_group("experts")
    g.add_argument("--moe-backend", choices=("auto",) + MOE_BACKENDS + their_values("moe_backend"), default="auto",
                   help="where experts run: resident = every expert on the device (fused: FreeToken's name for "
                   "it, accepted as the same); offload = every expert in "
                   "pinned host RAM with a device cache of expert slots, misses copied over PCIe; cpu = misses "
                   "computed on the CPU; hybrid = each step's misses split between PCIe copies and the CPU; "
                   "auto = offload when an expert cache flag is given, else resident when the checkpoint "
                   "fits in free device memory with room to spare (always on the CPU), else offload "
                   "(default: auto)")
    cache = g.add_mutually_exclusive_group()
    cache.add_argument("--moe-cache-size", type=_positive_int, metavar="SLOTS",
                       help="expert slots in the device cache (offload backends)")
    cache.add_argument("--moe-cache-rate", type=_fraction, metavar="FRACTION",
                       help="device expert cache as a fraction of all routed experts (offload backends)")
    cache.add_argument("--moe-cache-auto", action="store_true",
                       help="size the device expert cache from the measured memory plan (the default of the "
                       "offload backends when no size is given)")
    g.add_argument("--moe-cache-policy", choices=CACHE_POLICIES, default="lru",
                   help="offload and hybrid: which expert leaves the cache on a miss: lru, the least recently used "
                   "(the default), or lfu, the least frequently used with dynamic aging (fewer misses when a few "
                   "experts win most picks, as in trained models)")
    g.add_argument("--disable-moe-prefill-overlap", dest="moe_prefill_overlap", action="store_false",
                   help="offload/hybrid/cpu on CUDA: copy the next staged experts of a prefill chunk only after the "
                   "current ones are computed (default: overlapped on a copy stream)")
    g.add_argument("--disable-moe-decode-prefetch", dest="moe_decode_prefetch", action="store_false",
                   help="offload/hybrid on CUDA: fetch a decode step's misses only when their layer routes (default: "
                   "layer l+1's router applied to layer l's input predicts its experts, and the predicted "
                   "misses are copied on a copy stream while layer l computes)")
    g.add_argument("--moe-prefetch-width", type=_positive_int, metavar="N",
                   help="offload/hybrid on CUDA: experts a token's decode prefetch guesses for the next layer, its N "
                   "likeliest (default: the model's top-k)")
    g.add_argument("--moe-prefetch-budget", type=_positive_int, metavar="N",
                   help="offload/hybrid on CUDA: most of a token's guessed experts the decode prefetch copies, the "
                   "likeliest of those not cached (default: a quarter of the model's top-k; a wrong guess costs "
                   "link time, a missed one is fetched when its layer routes)")
    g.add_argument("--moe-cpu-threads", type=_positive_int, metavar="N",
                   help="cpu/hybrid backends and --moe-cpu-layers: threads computing experts on the CPU (the "
                   "worker's torch thread count, so on a CPU device every op's; default: torch's, the physical cores; "
                   "hybrid's CPU lane inside CUDA graphs: one fewer, the main thread waiting on the GPU meanwhile)")
    g.add_argument("--moe-cpu-layers", metavar="SPEC",
                   help="offload/cpu backends: MoE layers that keep no device slots; their decode experts run on "
                   "the CPU, their prefill chunks stream through the staging area. MoE-layer ids ('3,7,11', from "
                   "0), a count ('8': spread evenly over the depth) or a fraction ('0.5') (default: none)")
    g.add_argument("--moe-hybrid-max-fetch", type=_positive_int, metavar="N",
                   help="hybrid backend: at most N experts copied over PCIe per layer and step (default: no cap)")
    g.add_argument("--expert-load", choices=EXPERT_LOADS, default="auto",
                   help="how expert weights are read at boot (into the host banks of the offload backends): "
                   "serial = one expert after another; parallel = several threads read the experts whose format "
                   "needs a new layout, e.g. int4_awq (experts stored in their device layout are mapped views; "
                   "a layer's copies into banks or slots run in one batched call spread over torch's threads, "
                   "and from a layout's second layer on they come from the first layer's copy template, with "
                   "no per-expert work); auto = parallel when "
                   "free host RAM holds the banks plus every reader's layer, else serial (default: auto)")

    g = p.add_argument_group("memory")
    g.add_argument("--memory-ratio", type=_fraction, metavar="FRACTION",
                   help="fraction of the device memory free at start that the memory plan may use "
                   "(default: all of it; the plan keeps a measured margin)")
    g.add_argument("--gpu-memory-limit", type=parse_bytes, metavar="SIZE",
                   help="hard device memory budget for the memory plan, e.g. 16GiB (also enforced on the "
                   "allocator, so a big GPU behaves like a small one; on the CPU: the host memory budget)")
    g.add_argument("--kv-reserve-tokens", type=_positive_int, metavar="TOKENS",
                   help="KV tokens the memory plan keeps before giving the rest to expert slots")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-tokens", type=_positive_int, metavar="TOKENS",
                    help="KV cache capacity in tokens (default: the memory plan's; without a plan the context "
                    "length, so one full-length sequence always fits)")
    kv.add_argument("--num-pages", type=_positive_int, metavar="PAGES", help="KV cache capacity in pages")
    g.add_argument("--page-size", type=_positive_int, default=1, metavar="TOKENS",
                   help="tokens per KV page (default: 1)")
    g.add_argument("--disable-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every decode step eagerly (default: decode runs in CUDA graphs where it can)")
    g.add_argument("--cuda-graph-max-bs", "--graph", type=_positive_int, metavar="N",
                   help="largest decode batch captured in CUDA graphs; larger batches run eagerly (default: "
                   "--max-running-requests; fewer sizes capture faster at boot)")
    g.add_argument("--compile-workers", type=int, default=8, metavar="N",
                   help="CUDA: compile the boot's Triton kernels on N threads before the memory probe, found by walking "
                   "its and the warm-up's steps with nothing computed (default 8; 0: off, each kernel compiles at "
                   "its first launch, one after another)")

    g = p.add_argument_group("scheduling")
    g.add_argument("--max-seq-len-override", type=_positive_int, metavar="TOKENS",
                   help="context length (prompt + output) instead of the model's max_position_embeddings")
    g.add_argument("--max-running-requests", type=_positive_int, default=8, metavar="N",
                   help="sequences decoding at once (default: 8); recurrent-state slots are this, or "
                   "2N + 8 with the prefix cache (it keeps state checkpoints)")
    g.add_argument("--max-extend-tokens", "--max-prefill-length", "--max-extend-length", dest="max_extend_tokens",
                   type=_positive_int, default=8192, metavar="TOKENS",
                   help="new prompt tokens per step; longer prompts are prefilled in chunks (default: 8192)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="turn off the prefix cache (shared prompt prefixes are recomputed)")
    g.add_argument("--enable-special-token-ckpt", dest="special_token_ckpt", action="store_true",
                   help="save the recurrent (Gated DeltaNet) state just after each tool-call opener a response "
                   "generates, so an agent's next turn, which repeats the conversation through it, resumes from "
                   "the prefix cache there rather than at the previous prompt's end (needs the prefix cache and a "
                   "tool-call parser whose opener is one token, as <tool_call> is in Qwen3.5/3.6)")
    g.add_argument("--cache-type", choices=("radix", "naive"),
                   help="FreeToken's spelling of the prefix cache switch: radix = on (the default), naive = off "
                   "(as --no-prefix-cache)")
    g.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false",
                   help="read each step's tokens on the host before the next step starts (default: the next "
                   "step is launched first, fed from the tokens on the device, so the host's work between "
                   "steps overlaps the device's)")

    g.add_argument("--decode-log-interval", type=_positive_int, default=40, metavar="STEPS",
                   help="log one decode status line (running and queued requests, KV use, generated tokens/s, "
                   "the expert cache's hit rate) every STEPS steps with decode tokens; every step with prompt "
                   "tokens logs a prefill line (default: 40)")

    g = p.add_argument_group("api")
    g.add_argument("--max-output-tokens", type=_positive_int, metavar="TOKENS",
                   help="max_tokens of a request that sets none (default: generation_config.json's "
                   "max_new_tokens with --sampling-defaults model, else the rest of the context)")
    g.add_argument("--sampling-defaults", choices=("openai", "model") + their_values("sampling_defaults"),
                   default="model",
                   help="where unset sampling fields come from: model = the checkpoint's generation_config.json "
                   "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), then OpenAI's "
                   "defaults; openai (FreeToken: none) = OpenAI's defaults only (default: model)")
    g.add_argument("--enable-cache-report", action="store_true",
                   help="report prefix-cache hits in usage.prompt_tokens_details.cached_tokens")
    _add_api_arguments(p)
    add_freetoken_arguments(p)
    _mark_not_built(p)
    _environment_defaults(p)


def _add_api_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the agent-facing API: output parsers, authentication, CORS."""
    g = p.add_argument_group("agents and access")
    g.add_argument("--tool-call-parser", choices=("auto",) + TOOL_CALL_PARSERS + their_values("tool_call_parser")
                   + ("off",), default="auto",
                   help="how tool calls are read from the model's output into OpenAI tool_calls / Anthropic "
                   "tool_use: qwen3_coder = Qwen3.5/3.6 <function=...><parameter=...> XML; hermes (FreeToken: qwen, "
                   "qwen25) = Qwen3 JSON in <tool_call>; off = output stays text; auto = the format the chat "
                   "template teaches (default: auto)")
    g.add_argument("--reasoning-parser", choices=("auto",) + REASONING_PARSERS + ("off",), default="auto",
                   help="qwen3 = <think>...</think> goes to reasoning_content (Anthropic: thinking blocks); off = "
                   "it stays in the content; auto = qwen3 when the chat template knows <think> (default: auto)")
    g.add_argument("--api-key", metavar="KEY", help="require this key on every route but /health (as "
                   "'Authorization: Bearer KEY' or 'x-api-key: KEY'); better given as MOEFERRY_API_KEY, "
                   "which other users of the machine cannot read in the process list")
    g.add_argument("--cors-origins", metavar="ORIGINS", type=_origins,
                   help="comma-separated origins browsers may call from (e.g. http://localhost:3000), or * for "
                   "any (default: none; cross-origin browser requests are refused)")


def _origins(text: str) -> tuple[str, ...]:
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise argparse.ArgumentTypeError(f"'{o}' is not an origin (scheme://host[:port], or *)")
    return origins


ENV_PREFIX = "MOEFERRY_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_name(option: str) -> str:
    """--max-running-requests -> MOEFERRY_MAX_RUNNING_REQUESTS."""
    return ENV_PREFIX + option.lstrip("-").upper().replace("-", "_")


def _environment_defaults(p: argparse.ArgumentParser) -> None:
    """Every flag's default can come from MOEFERRY_<FLAG> (the command line wins). Values are
    checked like command-line values; a bad one stops the parse naming the variable."""
    defaults = {}
    for action in p._actions:
        names = [o for o in action.option_strings if o.startswith("--")]
        if not names or action.dest == "help":
            continue
        env = next((e for e in map(env_name, names) if e in os.environ), None)  # an alias's name too
        if env is None:
            continue
        raw = os.environ[env]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if raw.strip().lower() not in _TRUE + _FALSE:
                p.error(f"{env}={raw!r}: write 1/true/yes or 0/false/no")
            on = raw.strip().lower() in _TRUE
            defaults[action.dest] = action.const if on else action.default
            continue
        try:
            value = action.type(raw) if action.type else raw
        except (argparse.ArgumentTypeError, ValueError) as e:
            p.error(f"{env}={raw!r}: {e}")
        if action.choices is not None and value not in action.choices:
            p.error(f"{env}={raw!r}: choose from {', '.join(map(str, action.choices))}")
        defaults[action.dest] = value
    p.set_defaults(**defaults)
    env_help = ("Every flag can also be set as MOEFERRY_<FLAG> (e.g. MOEFERRY_PORT=8000); the command line wins. "
                "Except for flags the engine refuses together (one of --moe-cache-size/-rate/-auto with "
                "another; --kv-reserve-tokens with --num-tokens/--num-pages): a variable and the other flag "
                "are refused as two such flags are.")
    p.epilog = f"{p.epilog}\n\n{env_help}" if p.epilog else env_help


def _mark_not_built(p: argparse.ArgumentParser) -> None:
    """Say in --help which flags (or values) are refused for now, from the NOT_BUILT table."""
    by_option = {opt: action for action in p._actions for opt in action.option_strings}
    for n in NOT_BUILT:
        action = by_option[n.flag.split()[0]]
        what = f"'{n.flag.split()[1]}'" if " " in n.flag else "this flag"
        action.help = f"{action.help}. [{what} is not supported yet: it comes with {n.comes_with}]"


# ---------------------------------------------------------------- the config


@dataclass(frozen=True)
class ServeConfig:
    """The API process's settings plus the `EngineConfig` its worker builds from."""
    engine: EngineConfig
    sizes: EngineSizes  # what the flags imply before the engine resolves them (Ready reports the final ones)
    served_model_name: str
    is_demo: bool
    host: str
    port: int
    log_level: str
    model_max_seq_len: int  # the checkpoint's max_position_embeddings
    vocab_size: int
    max_output_tokens: int | None
    sampling_defaults: str
    enable_cache_report: bool
    # agents and access (resolved: a parser name or None for off)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    worker_stall_timeout: float = 60.0

    @property
    def model_dir(self) -> str:
        return self.engine.model_dir

    @property
    def max_seq_len(self) -> int:
        return self.sizes.max_seq_len

    @classmethod
    def from_args(cls, args: argparse.Namespace, demo_model: Callable[[], str] | None = None) -> "ServeConfig":
        """Validate and resolve. `demo_model()` makes (or finds) the demo checkpoint when --model is absent."""
        refused = [f"{n.flag} is not supported yet: it comes with {n.comes_with}" for n in not_built_flags(args)]
        refused += refused_freetoken_flags(args)
        if refused:
            raise ConfigError("\n".join(refused))
        if args.tensor_parallel_size != 1:
            raise ConfigError(f"--tensor-parallel-size {args.tensor_parallel_size}: moeferry serves a model from one "
                              "GPU (its experts offloaded to host RAM); tensor parallelism is not supported")
        if args.model is None:
            if demo_model is None:
                raise ConfigError("--model is required")
            model_dir, is_demo = demo_model(), True
        else:
            model_dir, is_demo = args.model, False
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"--model {model_dir}: no such directory")
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model_dir}: no config.json there (expected a Hugging Face model directory)")
        spec = _model_spec(path)
        api = _resolve_api(args, path)
        engine = _engine_config(args, str(path.resolve()), _checkpoint_tokens(args, path, api["tool_call_parser"]))
        if engine.max_seq_len is not None and engine.max_seq_len > spec.max_position_embeddings:
            warn_beyond_positions(engine.max_seq_len, spec.max_position_embeddings, "--max-seq-len-override")
        if args.served_model_name:
            name = args.served_model_name
        else:
            name = DEMO_MODEL_NAME if is_demo else path.resolve().name
        return cls(
            engine=engine, sizes=derive_sizes(engine, spec.max_position_embeddings), served_model_name=name,
            is_demo=is_demo, host=args.host, port=args.port, log_level=args.log_level,
            model_max_seq_len=spec.max_position_embeddings, vocab_size=spec.vocab_size,
            max_output_tokens=args.max_output_tokens,
            sampling_defaults=our_value("sampling_defaults", args.sampling_defaults),
            enable_cache_report=args.enable_cache_report, **api,
            worker_stall_timeout=args.worker_stall_timeout,
        )

    def table(self) -> str:
        """The boot table: every resolved value and where it came from."""
        e, z = self.engine, self.sizes
        rows = [
            ("model", e.model_dir),
            ("served as", self.served_model_name + ("  (random weights: a demo, not a real model)"
                                                    if self.is_demo else "")),
            ("device", e.device),
            ("dtype", e.dtype),
            ("moe backend", _backend_row(e)),
            ("expert load", e.expert_load),
            ("context", f"{z.max_seq_len} tokens" + ("" if z.max_seq_len == self.model_max_seq_len
                                                      else f" (model: {self.model_max_seq_len})")),
            ("vocabulary", str(self.vocab_size)),
            ("kv pool", f"{z.kv_tokens} tokens = {z.num_pages} pages x {z.page_size}" if not e.plans_memory
             and e.moe_backend in ("resident", "auto") and e.device == "cpu"
             else "sized by the memory plan at load" + (f" (at least {e.kv_reserve_tokens} tokens)"
                                                        if e.kv_reserve_tokens else "")),
            ("state slots", str(z.num_state_slots)),
            ("running requests", f"at most {e.max_running_requests}"),
            ("prefill chunk", f"{e.max_extend_tokens} tokens"),
            ("prefix cache", ("on" if e.prefix_cache else "off") + (
                f", states saved after token {', '.join(map(str, e.checkpoint_token_ids))} (the tool-call opener)"
                if e.checkpoint_token_ids else "")),
            ("max output", f"{self.max_output_tokens} tokens" if self.max_output_tokens else "rest of the context"),
            ("sampling defaults", self.sampling_defaults),
            ("cache report", "on" if self.enable_cache_report else "off"),
            ("status log", f"a line per prefill step, one per {e.decode_log_interval} decode steps"),
            ("worker watchdog", f"replaced after {self.worker_stall_timeout:g} s without progress"),
            ("listen", f"http://{self.host}:{self.port}"),
            ("tool calls", self.tool_call_parser or "off (text)"),
            ("reasoning", self.reasoning_parser or "off (text)"),
            ("api key", "required" if self.api_key else "none (open)"),
            ("cors origins", ", ".join(self.cors_origins) or "none"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _backend_row(e: EngineConfig) -> str:
    if e.moe_backend == "resident":
        return "resident (every expert on the device)"
    if e.moe_backend == "auto":
        return "auto (resident if the checkpoint fits the device, else offload; decided at load)"
    size = (f"{e.moe_cache_size} slots" if e.moe_cache_size else f"{e.moe_cache_rate:g} of the experts"
            if e.moe_cache_rate else "sized by the memory plan")
    on_cpu = f", MoE layers on the CPU: {e.moe_cpu_layers}" if e.moe_cpu_layers else ""
    return f"{e.moe_backend} (expert cache: {size}, policy {e.moe_cache_policy}{on_cpu})"


def _prefix_cache(args: argparse.Namespace) -> bool:
    """--no-prefix-cache, or FreeToken's --cache-type naive, turns it off."""
    if args.cache_type == "radix" and not args.prefix_cache:
        raise ConfigError("--cache-type radix turns the prefix cache on and --no-prefix-cache turns it off: "
                          "give one of them")
    return args.prefix_cache and args.cache_type != "naive"


def _checkpoint_tokens(args: argparse.Namespace, path: Path, tool_parser: str | None) -> tuple[int, ...]:
    """--enable-special-token-ckpt: the tool-call opener's token id."""
    if not args.special_token_ckpt:
        return ()
    from moeferry.text.tokenizer import Tokenizer
    from moeferry.text.tool_parsers import START

    if tool_parser is None:
        raise ConfigError("--enable-special-token-ckpt saves the state after the tool-call opener, and tool calls "
                          "are off (--tool-call-parser off, or a chat template without tools)")
    opener = Tokenizer.from_dir(path).added_token_id(START)
    if opener is None:
        raise ConfigError(f"--enable-special-token-ckpt: {START} is not one token in this model's tokenizer, so "
                          "no step ends on it")
    return (opener,)


def _engine_config(args: argparse.Namespace, model_dir: str, checkpoint_token_ids: tuple[int, ...]) -> EngineConfig:
    """The engine's half of the flags (pool sizes as given; the engine resolves the rest)."""
    device = _resolve_device(args.device)
    from moeferry.engine.engine import resolve_dtype

    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    num_tokens = args.num_pages * args.page_size if args.num_pages is not None else args.num_tokens
    try:  # EngineConfig checks the combinations (one place for serve and LLM)
        return EngineConfig(
            model_dir=model_dir, device=device, dtype=dtype, moe_backend=our_value("moe_backend", args.moe_backend),
            moe_cache_size=args.moe_cache_size, moe_cache_rate=args.moe_cache_rate,
            moe_cache_auto=args.moe_cache_auto, moe_cache_policy=args.moe_cache_policy,
            moe_prefill_overlap=args.moe_prefill_overlap,
            moe_decode_prefetch=args.moe_decode_prefetch, moe_prefetch_width=args.moe_prefetch_width,
            moe_prefetch_budget=args.moe_prefetch_budget,
            moe_cpu_threads=args.moe_cpu_threads,
            moe_cpu_layers=args.moe_cpu_layers, moe_hybrid_max_fetch=args.moe_hybrid_max_fetch,
            expert_load=args.expert_load, memory_ratio=args.memory_ratio, gpu_memory_limit=args.gpu_memory_limit,
            kv_reserve_tokens=args.kv_reserve_tokens, num_tokens=num_tokens, page_size=args.page_size,
            max_seq_len=args.max_seq_len_override, max_running_requests=args.max_running_requests,
            max_extend_tokens=args.max_extend_tokens, prefix_cache=_prefix_cache(args), cuda_graphs=args.cuda_graphs,
            cuda_graph_max_bs=args.cuda_graph_max_bs, decode_log_interval=args.decode_log_interval,
            checkpoint_token_ids=checkpoint_token_ids,
            overlap_schedule=args.overlap_schedule, compile_workers=args.compile_workers, progress=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _resolve_api(args: argparse.Namespace, path: Path) -> dict:
    """The agents-and-access fields; `auto` parsers resolved from the model's chat template."""
    from moeferry.text.reasoning import detect_reasoning_parser
    from moeferry.text.tokenizer import read_chat_template
    from moeferry.text.tool_parsers import detect_tool_parser

    template = read_chat_template(path)
    tools = {"auto": detect_tool_parser(template), "off": None}.get(args.tool_call_parser,
                                                                   our_value("tool_call_parser", args.tool_call_parser))
    reasoning = {"auto": detect_reasoning_parser(template), "off": None}.get(args.reasoning_parser,
                                                                            args.reasoning_parser)
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty")
    return dict(tool_call_parser=tools, reasoning_parser=reasoning, api_key=args.api_key,
                cors_origins=tuple(args.cors_origins or ()))


def warn_beyond_positions(value: int, model_max: int, name: str) -> None:
    """A context longer than the model's positions runs, but the model was not trained there."""
    logging.getLogger("moeferry.config").warning(
        "%s %d is beyond the model's max_position_embeddings (%d): positions past what it was trained on "
        "usually give degraded output", name, value, model_max)


def _model_spec(path: Path):
    from moeferry.checkpoint.reader import CheckpointError, CheckpointReader
    from moeferry.model.registry import resolve_spec

    try:
        return resolve_spec(CheckpointReader(str(path)))
    except CheckpointError as e:
        raise ConfigError(f"--model {path}: {e}") from None


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name
