"""FreeToken 0.1.2 `ft serve` flags that have no moeferry meaning.

Our users bring their FreeToken command lines. A flag moeferry does not know would stop the parse
with argparse's "unrecognized arguments", which says nothing about why. So every flag of
FreeToken 0.1.2's `ft serve --help` parses here, and one that cannot act is refused with its reason:

- `VALUE_ALIASES`: FreeToken's names for values moeferry spells otherwise (`--moe-backend fused`
  is our `resident`), accepted as ours.
- `ONE_VALUE`: flags that choose among implementations where moeferry has one. The value that
  names moeferry's (or `auto`) is accepted; any other is refused at the parse, saying what runs.
- `REFUSED`: flags whose feature moeferry does not have. Giving one (on the command line or as
  MOEFERRY_<FLAG>) is refused by `ServeConfig.from_args` with the reason; none is accepted and
  ignored.

The flags with a moeferry meaning (`--moe-backend`, `--cache-type`, `--decode-log-interval`,
`--enable-special-token-ckpt`, ...) are declared with the others in `moeferry/config.py`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class OneValue:
    names: tuple[str, ...]
    accepted: tuple[str, ...]  # the first is the default
    why: str  # what moeferry runs instead of the other values

    def parse(self, text: str) -> str:
        if text.strip() in self.accepted:
            return text.strip()
        raise argparse.ArgumentTypeError(f"'{text}' is not available: {self.why} "
                                         f"(accepted: {', '.join(self.accepted)})")


@dataclass(frozen=True)
class Refused:
    names: tuple[str, ...]
    why: str
    metavar: str | None = None  # None: a switch

    @property
    def dest(self) -> str:
        return "freetoken_" + self.names[0].lstrip("-").replace("-", "_")


# flag dest -> {FreeToken's value: ours}
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "moe_backend": {"fused": "resident"},  # its experts-on-the-device backend
    "sampling_defaults": {"none": "openai"},  # the request's fields, then the API's defaults only
    "tool_call_parser": {"qwen": "hermes", "qwen25": "hermes"},  # Qwen2.5/Qwen3 JSON in <tool_call>
}


def their_values(dest: str) -> tuple[str, ...]:
    """FreeToken's spellings of a flag's values, to add to its choices."""
    return tuple(VALUE_ALIASES.get(dest, {}))


def our_value(dest: str, value):
    return VALUE_ALIASES.get(dest, {}).get(value, value)


ONE_VALUE: tuple[OneValue, ...] = (
    OneValue(("--attention-backend", "--attn"), ("auto", "triton", "triton,triton"),
             "moeferry has one attention implementation, its Triton kernels on CUDA (PyTorch on the CPU)"),
    OneValue(("--nvfp4-backend",), ("auto", "triton"),
             "moeferry computes NVFP4 experts with its own Triton kernels (no Marlin or FlashInfer)"),
    OneValue(("--num-tokenizer", "--tokenizer-count"), ("0",),
             "moeferry tokenizes and detokenizes in the API process (FreeToken's 0); separate tokenizer "
             "processes are not supported"),
)

REFUSED: tuple[Refused, ...] = (
    Refused(("--dummy-weight",), "moeferry serves checkpoints; write one with random weights with "
            "`moeferry make-model` (serving without --model serves such a demo model)"),
    Refused(("--model-source",), "moeferry downloads nothing: --model names a local model directory",
            metavar="SOURCE"),
    Refused(("--disable-pynccl",), "it configures tensor parallelism, which moeferry does not have "
            "(a model is served from one GPU)"),
    Refused(("--moe-prefill-hit-d2d",), "moeferry's prefill already computes cached experts in their slots and "
            "copies only the misses, so there is nothing for it to turn on"),
    Refused(("--shell-mode",), "moeferry has no terminal shell (`ft shell`); run `moeferry serve` and point a "
            "client at it"),
)


def add_freetoken_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("FreeToken flags without a moeferry meaning",
                             "accepted with the one value that names what moeferry runs; the rest are refused "
                             "with the reason")
    for f in ONE_VALUE:
        g.add_argument(*f.names, type=f.parse, default=f.accepted[0], metavar="VALUE",
                       help=f"{' | '.join(f.accepted)}: {f.why} (default: {f.accepted[0]})")
    for f in REFUSED:
        if f.metavar is None:
            g.add_argument(*f.names, dest=f.dest, action="store_true", help=f"refused: {f.why}")
        else:
            g.add_argument(*f.names, dest=f.dest, metavar=f.metavar, help=f"refused: {f.why}")


def refused_freetoken_flags(args: argparse.Namespace) -> list[str]:
    """Why each refused flag `args` carries cannot run."""
    return [f"{f.names[0]}: {f.why}" for f in REFUSED if getattr(args, f.dest) not in (None, False)]
