"""ServeConfig: every `serve` flag, validated once, resolved once, frozen.

`add_serve_arguments` declares the flags (their help is the reference), `ServeConfig.from_args`
turns a parsed namespace into the one config object the server uses. Flags whose feature is
not built yet are listed in `NOT_BUILT` (the single table of them) and refused with the issue
that will add them; nothing is accepted and ignored.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


_OFFLOAD = "the expert-offload issue (experts in host RAM, a GPU cache of expert slots)"
_PLANNER = "the memory-planner issue (measured memory plan, boot self-test, OOM guard)"

# The one table of flags that parse but whose feature is not built yet.
NOT_BUILT: tuple[NotBuilt, ...] = (
    NotBuilt("--moe-backend offload", lambda a: a.moe_backend == "offload", _OFFLOAD),
    NotBuilt("--moe-backend cpu", lambda a: a.moe_backend == "cpu",
             "the CPU-expert issue (expert misses computed on the CPU from host banks)"),
    NotBuilt("--moe-backend hybrid", lambda a: a.moe_backend == "hybrid",
             "the hybrid-expert issue (misses split between PCIe fetches and CPU compute)"),
    NotBuilt("--moe-cache-size", lambda a: a.moe_cache_size is not None, _OFFLOAD),
    NotBuilt("--moe-cache-rate", lambda a: a.moe_cache_rate is not None, _OFFLOAD),
    NotBuilt("--moe-cache-auto", lambda a: a.moe_cache_auto, _PLANNER),
    NotBuilt("--kv-reserve-tokens", lambda a: a.kv_reserve_tokens is not None, _PLANNER),
    NotBuilt("--memory-ratio", lambda a: a.memory_ratio is not None, _PLANNER),
    NotBuilt("--gpu-memory-limit", lambda a: a.gpu_memory_limit is not None, _PLANNER),
    NotBuilt("--expert-load parallel", lambda a: a.expert_load == "parallel", _OFFLOAD),
)


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json, safetensors, "
                   "tokenizer). Without it the built-in random-weight demo model is made in the user cache "
                   "directory on first use and served.")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="model id clients send and /v1/models lists (default: the model directory's name)")
    g.add_argument("--device", type=_device, default="auto", help="auto (cuda if available, else cpu), cpu, cuda, "
                   "cuda:N (default: auto)")
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
    g.add_argument("--moe-backend", choices=("auto", "resident", "offload", "cpu", "hybrid"), default="auto",
                   help="where experts run: resident = all experts on the device; offload = experts in host RAM "
                   "with a device slot cache; cpu = misses computed on the CPU; hybrid = split between the two; "
                   "auto = resident (the only backend built so far) (default: auto)")
    cache = g.add_mutually_exclusive_group()
    cache.add_argument("--moe-cache-size", type=_positive_int, metavar="SLOTS",
                       help="expert slots in the device cache (offload backends)")
    cache.add_argument("--moe-cache-rate", type=_fraction, metavar="FRACTION",
                       help="device expert cache as a fraction of all experts (offload backends)")
    cache.add_argument("--moe-cache-auto", action="store_true",
                       help="size the device expert cache from the measured memory plan")
    g.add_argument("--expert-load", choices=("auto", "serial", "parallel"), default="auto",
                   help="how expert weights are read at boot: serial = one layer after another; parallel = "
                   "several reader threads into pinned host banks; auto = serial (default: auto)")

    g = p.add_argument_group("memory")
    g.add_argument("--memory-ratio", type=_fraction, metavar="FRACTION",
                   help="fraction of free device memory the memory plan may use")
    g.add_argument("--gpu-memory-limit", type=parse_bytes, metavar="SIZE",
                   help="hard device memory budget for the memory plan, e.g. 16GiB")
    g.add_argument("--kv-reserve-tokens", type=_positive_int, metavar="TOKENS",
                   help="KV tokens the memory plan keeps before giving the rest to experts")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-tokens", type=_positive_int, metavar="TOKENS",
                    help="KV cache capacity in tokens (default: the context length, so one full-length "
                    "sequence always fits)")
    kv.add_argument("--num-pages", type=_positive_int, metavar="PAGES", help="KV cache capacity in pages")
    g.add_argument("--page-size", type=_positive_int, default=1, metavar="TOKENS",
                   help="tokens per KV page (default: 1)")

    g = p.add_argument_group("scheduling")
    g.add_argument("--max-seq-len-override", type=_positive_int, metavar="TOKENS",
                   help="context length (prompt + output) instead of the model's max_position_embeddings")
    g.add_argument("--max-running-requests", type=_positive_int, default=8, metavar="N",
                   help="sequences decoding at once (default: 8); recurrent-state slots are this, or "
                   "2N + 8 with the prefix cache (it keeps state checkpoints)")
    g.add_argument("--max-extend-tokens", "--max-prefill-length", dest="max_extend_tokens", type=_positive_int,
                   default=8192, metavar="TOKENS",
                   help="new prompt tokens per step; longer prompts are prefilled in chunks (default: 8192)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="turn off the prefix cache (shared prompt prefixes are recomputed)")

    g = p.add_argument_group("api")
    g.add_argument("--max-output-tokens", type=_positive_int, metavar="TOKENS",
                   help="max_tokens of a request that sets none (default: generation_config.json's "
                   "max_new_tokens with --sampling-defaults model, else the rest of the context)")
    g.add_argument("--sampling-defaults", choices=("openai", "model"), default="model",
                   help="where unset sampling fields come from: model = the checkpoint's generation_config.json "
                   "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), then OpenAI's "
                   "defaults; openai = OpenAI's defaults only (default: model)")
    g.add_argument("--enable-cache-report", action="store_true",
                   help="report prefix-cache hits in usage.prompt_tokens_details.cached_tokens")
    _mark_not_built(p)


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
    model_dir: str
    served_model_name: str
    is_demo: bool
    host: str
    port: int
    log_level: str
    device: str  # resolved: cpu, cuda or cuda:N
    dtype: str  # resolved: float32, bfloat16 or float16
    moe_backend: str  # resolved: resident
    expert_load: str  # resolved: serial
    max_seq_len: int  # context length, prompt + output
    model_max_seq_len: int  # the checkpoint's max_position_embeddings
    vocab_size: int
    page_size: int
    num_pages: int
    num_state_slots: int
    max_running_requests: int
    max_extend_tokens: int
    prefix_cache: bool
    max_output_tokens: int | None
    sampling_defaults: str
    enable_cache_report: bool
    worker_stall_timeout: float

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def from_args(cls, args: argparse.Namespace, demo_model: Callable[[], str] | None = None) -> "ServeConfig":
        """Validate and resolve. `demo_model()` makes (or finds) the demo checkpoint when --model is absent."""
        refused = not_built_flags(args)
        if refused:
            raise ConfigError("\n".join(f"{n.flag} is not supported yet: it comes with {n.comes_with}"
                                        for n in refused))
        if args.model is None:
            if demo_model is None:
                raise ConfigError("--model is required")
            model_dir, is_demo = demo_model(), True
        else:
            model_dir, is_demo = args.model, False
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model_dir}: no config.json there (expected a Hugging Face model directory)")
        spec = _model_spec(path)
        model_max = spec.max_position_embeddings
        max_seq_len = args.max_seq_len_override or model_max
        if args.num_pages is not None:
            num_pages = args.num_pages
        else:
            num_pages = -(-(args.num_tokens or max_seq_len) // args.page_size)
        # A sequence can never outgrow the KV pool, so the pool bounds the context too.
        max_seq_len = min(max_seq_len, num_pages * args.page_size)
        device = _resolve_device(args.device)
        from moeferry.engine.engine import resolve_dtype

        dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
        if args.served_model_name:
            name = args.served_model_name
        else:
            name = DEMO_MODEL_NAME if is_demo else path.resolve().name
        return cls(
            model_dir=str(path.resolve()), served_model_name=name, is_demo=is_demo, host=args.host,
            port=args.port, log_level=args.log_level, device=device, dtype=dtype, moe_backend="resident",
            expert_load="serial", max_seq_len=max_seq_len, model_max_seq_len=model_max,
            vocab_size=spec.vocab_size, page_size=args.page_size,
            num_pages=num_pages, num_state_slots=_state_slots(args.max_running_requests, args.prefix_cache),
            max_running_requests=args.max_running_requests, max_extend_tokens=args.max_extend_tokens,
            prefix_cache=args.prefix_cache, max_output_tokens=args.max_output_tokens,
            sampling_defaults=args.sampling_defaults, enable_cache_report=args.enable_cache_report,
            worker_stall_timeout=args.worker_stall_timeout,
        )

    def table(self) -> str:
        """The boot table: every resolved value and where it came from."""
        rows = [
            ("model", self.model_dir),
            ("served as", self.served_model_name + ("  (random weights: a demo, not a real model)"
                                                    if self.is_demo else "")),
            ("device", self.device),
            ("dtype", self.dtype),
            ("moe backend", f"{self.moe_backend} (all experts on the device)"),
            ("expert load", self.expert_load),
            ("context", f"{self.max_seq_len} tokens" + ("" if self.max_seq_len == self.model_max_seq_len
                                                         else f" (model: {self.model_max_seq_len})")),
            ("vocabulary", str(self.vocab_size)),
            ("kv pool", f"{self.kv_tokens} tokens = {self.num_pages} pages x {self.page_size}"),
            ("state slots", str(self.num_state_slots)),
            ("running requests", f"at most {self.max_running_requests}"),
            ("prefill chunk", f"{self.max_extend_tokens} tokens"),
            ("prefix cache", "on" if self.prefix_cache else "off"),
            ("max output", f"{self.max_output_tokens} tokens" if self.max_output_tokens else "rest of the context"),
            ("sampling defaults", self.sampling_defaults),
            ("cache report", "on" if self.enable_cache_report else "off"),
            ("worker watchdog", f"replaced after {self.worker_stall_timeout:g} s without progress"),
            ("listen", f"http://{self.host}:{self.port}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _state_slots(max_running: int, prefix_cache: bool) -> int:
    """One recurrent-state slot per running sequence, plus room for the prefix cache's GDN
    checkpoints (the same rule as `LLM`)."""
    return 2 * max_running + 8 if prefix_cache else max_running


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
