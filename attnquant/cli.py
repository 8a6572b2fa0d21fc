"""The ``attnquant`` command line.

Subcommands live in a registry: a module adds one with
:func:`register_subcommand` when it is imported, and :data:`SUBCOMMAND_MODULES`
lists the modules :func:`main` imports to collect them (they are imported
only when the CLI runs, so ``import attnquant`` stays light).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from attnquant import __version__, nvfp4, prepare_device
from attnquant.checkpoint import load_state_dict, read_config
from attnquant.config import AttnQuantConfig
from attnquant.projections import PROJECTIONS_BY_BLOCK, ProjectionKey
from attnquant.reconstruct import PrecomputeReport, precompute_outside

SUBCOMMAND_MODULES: tuple[str, ...] = ("attnquant.demo", "attnquant.verify")
"""Modules that register more subcommands (e.g. ``demo-model``, ``verify``)."""


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


# ---------------------------------------------------------------------------
# attnquant quantize
# ---------------------------------------------------------------------------

WEIGHTS_FILE = "model.safetensors"
# Files of the source checkpoint that are not copied: its weights (replaced)
# and the two configs we rewrite.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")
_REWRITTEN = ("config.json", "hf_quant_config.json")


def _add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", type=Path, metavar="MODEL_DIR", help="Hugging Face checkpoint directory"
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="OUT_DIR",
        help="where to write the NVFP4 checkpoint",
    )
    parser.add_argument(
        "--ignore",
        nargs="+",
        action="extend",
        default=None,
        metavar="FRAG",
        help="module-name fragments to leave unquantized: self_attn, mlp, o_proj, layers.0, ... "
        "(as ATTNQUANT_QUANT_IGNORE)",
    )
    parser.add_argument(
        "--blocks", type=int, default=None, metavar="N", help="theta bands G (ATTNQUANT_BLOCKS)"
    )
    parser.add_argument(
        "--rank", type=int, default=None, metavar="R", help="theta residual rank (ATTNQUANT_RANK)"
    )
    parser.add_argument(
        "--scale-search",
        choices=("rtn", "mse"),
        default=None,
        help="NVFP4 block-scale choice (ATTNQUANT_SCALE_SEARCH)",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _quantize_config(args: argparse.Namespace) -> AttnQuantConfig:
    """The ATTNQUANT_* environment with the flags given laid over it, so that
    flags are parsed and checked exactly like the variables they stand for."""
    flags = {
        "ATTNQUANT_BLOCKS": args.blocks,
        "ATTNQUANT_RANK": args.rank,
        "ATTNQUANT_SCALE_SEARCH": args.scale_search,
        "ATTNQUANT_QUANT_IGNORE": None if args.ignore is None else ",".join(args.ignore),
    }
    env = {
        **os.environ,
        **{name: str(value) for name, value in flags.items() if value is not None},
        "ATTNQUANT_QUANT": "nvfp4",
        "ATTNQUANT_PRECOMPUTE_OUTSIDE": "1",
    }
    return AttnQuantConfig.from_env(env)


def run_quantize(args: argparse.Namespace) -> int:
    out: Path = args.out.absolute()
    _check_output_dir(out, force=args.force)
    config = _quantize_config(args)
    source_config = read_config(args.model_dir)
    state_dict = load_state_dict(args.model_dir)
    prepare = prepare_device.for_host(config.prepare_device)
    result = precompute_outside(state_dict, config, progress=not args.no_progress, device=prepare.device)
    prepare_device.release(prepare)
    ignore = modelopt_ignore_list(result.report)

    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(result.state_dict, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(
            staging / "config.json",
            {**source_config, "quantization_config": quantization_config(ignore)},
        )
        _write_json(staging / "hf_quant_config.json", hf_quant_config(ignore))
        _copy_side_files(Path(args.model_dir), staging)
        _replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"{result.report.summary_line()}; prepared on {prepare.device} ({prepare.reason}); wrote {out}")
    return 0


def _check_output_dir(out: Path, *, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty; pass --force to replace it")


def modelopt_ignore_list(report: PrecomputeReport) -> list[str]:
    """ModelOpt ``ignore`` entries: lm_head (never quantized), each ignored
    projection, and a ``<block>*`` glob for every attention/MLP block whose
    projections are all ignored (MAX reads ignores per block)."""
    ignored = set(report.ignored_modules)
    blocks_fully_ignored = set()
    for module in ignored:
        key = ProjectionKey.parse(f"{module}.weight")
        assert key is not None
        block_module = key.module_name.removesuffix(f".{key.proj}")
        siblings = {f"{block_module}.{proj}" for proj in PROJECTIONS_BY_BLOCK[key.block]}
        if siblings <= ignored:
            blocks_fully_ignored.add(f"{block_module}*")
    return ["lm_head", *sorted(ignored), *sorted(blocks_fully_ignored)]


def quantization_config(ignore: list[str]) -> dict[str, object]:
    """config.json's ``quantization_config`` for a ModelOpt NVFP4 checkpoint."""
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": nvfp4.BLOCK_SIZE,
        "ignore": ignore,
    }


def hf_quant_config(ignore: list[str]) -> dict[str, object]:
    """The standalone ``hf_quant_config.json`` ModelOpt exports beside it."""
    return {
        "producer": {"name": "modelopt", "version": f"attnquant-{__version__}"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": nvfp4.BLOCK_SIZE,
            "ignore": ignore,
        },
    }


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _copy_side_files(model_dir: Path, staging: Path) -> None:
    """Tokenizer, generation config, chat template...: every top-level file
    that is neither a weight file nor one of the configs we rewrite."""
    for path in model_dir.iterdir():
        if (
            path.is_file()
            and path.name not in _REWRITTEN
            and not path.name.endswith(_NOT_COPIED_SUFFIXES)
        ):
            shutil.copy2(path, staging / path.name)


def _replace_dir(staging: Path, out: Path) -> None:
    """Renames the finished staging directory to ``out`` (same filesystem, so
    the rename is atomic); an existing ``out`` is moved aside first."""
    for path in staging.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    previous = out.parent / f".{out.name}.previous-{os.getpid()}"
    if out.exists():
        os.replace(out, previous)
    os.replace(staging, out)
    shutil.rmtree(previous, ignore_errors=True)


register_subcommand(
    "quantize",
    "write an NVFP4 (ModelOpt layout) copy of a Hugging Face checkpoint",
    _add_quantize_arguments,
    run_quantize,
)
