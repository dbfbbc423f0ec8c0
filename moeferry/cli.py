"""The `moeferry` / `ft` command line: one entry per subcommand in COMMANDS."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from moeferry.config import add_serve_arguments

    add_serve_arguments(p)


def _serve(args: argparse.Namespace) -> int:
    from moeferry.server.first_worker import FirstWorker

    first = FirstWorker()  # the engine worker's imports run while this process resolves its configuration
    from moeferry.config import ConfigError, ServeConfig
    from moeferry.server.demo import ensure_demo_model

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = ServeConfig.from_args(args, demo_model=ensure_demo_model)
    except ConfigError as e:
        first.cancel()
        print(f"moeferry serve: error: {e}", file=sys.stderr)
        return 2
    from moeferry.server.app import serve

    return serve(cfg, first)


def _make_model_arguments(p: argparse.ArgumentParser) -> None:
    from moeferry.checkpoint.formats import PRESETS
    from moeferry.checkpoint.synthetic import ARCHS, EXPERT_LAYOUTS, SIZES

    p.add_argument("--arch", required=True, choices=ARCHS, help="model family")
    p.add_argument("--size", default="tiny", choices=SIZES,
                   help="tiny (CPU tests), small (a few hundred MB), or a real geometry")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--expert-layout", default="per-expert", choices=EXPERT_LAYOUTS,
                   help="experts stored per expert or fused [E, 2I, H] / [E, H, I]")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed = same weights)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of unquantized tensors")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--multimodal", action="store_true",
                   help="Qwen3.5/3.6 release layout (model.language_model.*, visual and mtp tensors)")
    p.add_argument("--quant", default=None, choices=sorted(PRESETS), help="write a quantized checkpoint")
    p.add_argument("--router-skew", type=_router_skew, default=0.0, metavar="S",
                   help="skew each MoE router's expert popularity Zipf-like: in every layer a seeded permutation "
                   "ranks the experts, and rank r's router row is scaled by (r+1)^-S, so popular experts win the "
                   "top-k far more often (top 10%% of experts: ~40%% of the picks at 0.25, ~65%% at 0.5 for "
                   "256 experts top-8). 0 = off, random routers spread tokens almost uniformly (default: 0)")


def _router_skew(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _make_model(args: argparse.Namespace) -> int:
    from moeferry.checkpoint.synthetic import make_model

    path = make_model(args.out, args.arch, args.size, expert_layout=args.expert_layout, seed=args.seed,
                      dtype=args.dtype, multimodal=args.multimodal, num_layers=args.num_layers, quant=args.quant,
                      router_skew=args.router_skew)
    skew = f", router skew {args.router_skew:g}" if args.router_skew else ""
    print(f"wrote random-weight {args.arch} ({args.size}{skew}) checkpoint to {path}")
    return 0


def _module_command(help: str, module: str) -> Command:
    """A command whose module (its `add_arguments(parser)` and `main(args)`) is imported on use."""
    def add_arguments(p: argparse.ArgumentParser) -> None:
        importlib.import_module(module).add_arguments(p)

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).main(args)

    return Command(help, add_arguments, run)


# `moeferry bench NAME`: one entry per benchmark.
BENCHES: dict[str, Command] = {
    "serve": _module_command("load-test an OpenAI-compatible server: TTFT / TPOT / ITL percentiles and throughput",
                             "moeferry.bench.serve"),
    "bw": _module_command("measure an expert miss's two lanes: pinned host->device copy and CPU expert compute",
                          "moeferry.bench.bw"),
}


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, cmd in BENCHES.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))


def _bench(args: argparse.Namespace) -> int:
    return BENCHES[args.bench].run(args)


COMMANDS: dict[str, Command] = {
    "serve": Command("serve a model over OpenAI- and Anthropic-compatible HTTP", _serve_arguments, _serve),
    "bench": Command("benchmarks: serve (load generator against a running server), bw (expert-miss lanes)",
                     _bench_arguments, _bench),
    "make-model": Command("write a random-weight Hugging Face checkpoint (tests, demos, benchmarks)",
                          _make_model_arguments, _make_model),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (`command`) only that command's arguments: each command's
    imports its own (`serve`'s do not import torch, so that its engine worker starts first)."""
    from moeferry import __version__

    parser = argparse.ArgumentParser(prog="moeferry", description="Serve large Mixture-of-Experts language models "
                                     "from one consumer GPU.")
    parser.add_argument("--version", action="version", version=f"moeferry {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if command in (None, name):
            cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
