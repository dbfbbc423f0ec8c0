"""The `moeferry` / `ft` command line: one entry per subcommand in COMMANDS."""
from __future__ import annotations

import argparse
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
    from moeferry.config import ConfigError, ServeConfig
    from moeferry.server.demo import ensure_demo_model

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = ServeConfig.from_args(args, demo_model=ensure_demo_model)
    except ConfigError as e:
        print(f"moeferry serve: error: {e}", file=sys.stderr)
        return 2
    from moeferry.server.app import serve

    return serve(cfg)


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


def _make_model(args: argparse.Namespace) -> int:
    from moeferry.checkpoint.synthetic import make_model

    path = make_model(args.out, args.arch, args.size, expert_layout=args.expert_layout, seed=args.seed,
                      dtype=args.dtype, multimodal=args.multimodal, num_layers=args.num_layers, quant=args.quant)
    print(f"wrote random-weight {args.arch} ({args.size}) checkpoint to {path}")
    return 0


def _bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    from moeferry.bench.serve import add_arguments

    add_arguments(p)


def _bench_serve(args: argparse.Namespace) -> int:
    from moeferry.bench.serve import main

    return main(args)


# `moeferry bench NAME`: one entry per benchmark.
BENCHES: dict[str, Command] = {
    "serve": Command("load-test an OpenAI-compatible server: TTFT / TPOT / ITL percentiles and throughput",
                     _bench_serve_arguments, _bench_serve),
}


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, cmd in BENCHES.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))


def _bench(args: argparse.Namespace) -> int:
    return BENCHES[args.bench].run(args)


COMMANDS: dict[str, Command] = {
    "serve": Command("serve a model over OpenAI- and Anthropic-compatible HTTP", _serve_arguments, _serve),
    "bench": Command("benchmarks: serve (load generator against a running server)", _bench_arguments, _bench),
    "make-model": Command("write a random-weight Hugging Face checkpoint (tests, demos, benchmarks)",
                          _make_model_arguments, _make_model),
}


def build_parser() -> argparse.ArgumentParser:
    from moeferry import __version__

    parser = argparse.ArgumentParser(prog="moeferry", description="Serve large Mixture-of-Experts language models "
                                     "from one consumer GPU.")
    parser.add_argument("--version", action="version", version=f"moeferry {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
