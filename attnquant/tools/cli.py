"""The ``attnquant`` command line.

Subcommands live in a registry: a module adds one with
:func:`register_subcommand` when it is imported, and :data:`SUBCOMMAND_MODULES`
lists the modules :func:`main` imports to collect them (they are imported
only when the CLI runs, so ``import attnquant`` stays light).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from attnquant import __version__
from attnquant.config import choices_of

SUBCOMMAND_MODULES: tuple[str, ...] = ("attnquant.tools.quantize", "attnquant.tools.verify", "attnquant.tools.demo")
"""Modules that register the subcommands (``quantize``, ``verify``, ``demo``, ``demo-model``)."""


@dataclass(frozen=True)
class Subcommand:
    """One ``attnquant NAME`` command: its help, its arguments, its body."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


_SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """Adds ``attnquant NAME``; ``run`` gets the parsed arguments and returns
    the exit status. It may raise ValueError for bad input (printed, exit 2)."""
    if name in _SUBCOMMANDS:
        raise ValueError(f"attnquant subcommand {name!r} is registered twice")
    _SUBCOMMANDS[name] = Subcommand(name, help, add_arguments, run)


def build_parser() -> argparse.ArgumentParser:
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(
        prog="attnquant", description="Gemma on MAX with NVFP4 projections."
    )
    parser.add_argument("--version", action="version", version=f"attnquant {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _SUBCOMMANDS.values():
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"attnquant: error: {error}", file=sys.stderr)
        return 2


# Flags that stand for the ATTNQUANT_* settings deciding the served weights,
# shared by `quantize` and `verify`: (flag, variable, argparse options).
_WEIGHT_FLAGS: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("--ignore", "ATTNQUANT_QUANT_IGNORE", dict(
        nargs="+", action="extend", metavar="FRAG",
        help="module-name fragments left unquantized: self_attn, mlp, o_proj, layers.0, ... "
        "(as ATTNQUANT_QUANT_IGNORE)",
    )),
    ("--blocks", "ATTNQUANT_BLOCKS", dict(type=int, metavar="G", help="theta bands G (ATTNQUANT_BLOCKS)")),
    ("--rank", "ATTNQUANT_RANK", dict(type=int, metavar="R", help="theta residual rank (ATTNQUANT_RANK)")),
    ("--scale-search", "ATTNQUANT_SCALE_SEARCH", dict(
        choices=choices_of("ATTNQUANT_SCALE_SEARCH"), help="NVFP4 block-scale choice (ATTNQUANT_SCALE_SEARCH)",
    )),
    ("--lm-head", "ATTNQUANT_LM_HEAD", dict(
        choices=choices_of("ATTNQUANT_LM_HEAD"), help="the output head's weights (ATTNQUANT_LM_HEAD)",
    )),
)  # fmt: skip


def add_weight_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the flags that stand for the weight settings (unset: the environment's)."""
    for flag, _, options in _WEIGHT_FLAGS:
        parser.add_argument(flag, default=None, **options)  # type: ignore[arg-type]


def with_weight_flags(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the weight flags given laid over it, so that flags are parsed
    and checked exactly like the variables they stand for."""
    overlaid = dict(env)
    for flag, variable, _ in _WEIGHT_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overlaid[variable] = ",".join(value) if isinstance(value, list) else str(value)
    return overlaid
