"""``attnquant quantize``: write an NVFP4 copy of a checkpoint in NVIDIA's
ModelOpt layout (the format ``nvidia/*-NVFP4`` exports use).

The copy holds what a load with ``ATTNQUANT_QUANT=nvfp4`` would serve:
every projection (not in ``--ignore``) as packed E2M1 codes, E4M3 block
scales and a global scale; every other tensor as it was. It is written beside
``--out`` and renamed into place when complete, so a killed run leaves no
half-written checkpoint (and the next run removes its staging directory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from attnquant import __version__
from attnquant.config import AttnQuantConfig
from attnquant.files import atomic_directory
from attnquant.formats import nvfp4
from attnquant.formats.names import PROJECTIONS_BY_BLOCK, ProjectionKey, find_projections
from attnquant.load import importance, prepare_device
from attnquant.load.checkpoint import load_state_dict, read_config
from attnquant.load.precompute import num_layers_of, precompute_outside
from attnquant.load.report import LoadReport
from attnquant.tools.cli import add_weight_flags, register_subcommand, with_weight_flags

WEIGHTS_FILE = "model.safetensors"
# Files of the source checkpoint that are not copied: its weights (replaced)
# and the two configs we rewrite.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")
_REWRITTEN = ("config.json", "hf_quant_config.json")


def _add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="Hugging Face checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, metavar="OUT_DIR", help="where to write the NVFP4 checkpoint")
    add_weight_flags(parser)
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def quantize_config(args: argparse.Namespace) -> AttnQuantConfig:
    """The environment's ATTNQUANT_* settings with the flags laid over them,
    NVFP4 computed on the host."""
    env = with_weight_flags(args, os.environ)
    config = AttnQuantConfig.from_env({**env, "ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_PRECOMPUTE_OUTSIDE": "1"})
    if config.lm_head != "bf16":
        # A ModelOpt export keeps lm_head unquantized (its ignore list says so),
        # and a tied head is the embedding the token lookup reads.
        raise ValueError(
            f"ATTNQUANT_LM_HEAD={config.lm_head}: quantize writes the output head unquantized, as ModelOpt "
            "exports do; leave it at bf16 here (or unset it)"
        )
    return config


def run_quantize(args: argparse.Namespace) -> int:
    source, out = Path(args.model_dir).resolve(), args.out.resolve()
    check_output_dir(source, out, force=args.force)
    config = quantize_config(args)
    source_config = read_config(source)
    state_dict = load_state_dict(source)
    keys = find_projections(state_dict)
    prepare = prepare_device.for_host(config.prepare_device)
    try:
        importances = importance.for_quantization(
            state_dict, keys, config, importance.for_checkpoint_config(source_config)
        )
        result = precompute_outside(
            state_dict, config, keys=keys, importance=importances, progress=not args.no_progress, device=prepare.device
        )
    finally:
        prepare_device.release(prepare)
    ignore = modelopt_ignore_list(result.ignored_modules)
    with atomic_directory(out) as staging:
        save_file(result.state_dict, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(staging / "config.json", {**source_config, "quantization_config": quantization_config(ignore)})
        _write_json(staging / "hf_quant_config.json", hf_quant_config(ignore))
        _copy_side_files(source, staging)
    report = LoadReport.measure(
        before=state_dict, served=result.state_dict, keys=keys, quantized=len(result.quantized_modules),
        path=f"precompute-outside (prepared on {prepare.device}: {prepare.reason})",
        blocks=config.blocks or num_layers_of(keys), num_layers=num_layers_of(keys),
        rank=config.rank, quant="nvfp4", source=f"wrote {out}", layer_errors=result.layer_errors,
    )  # fmt: skip
    print(report.line("attnquant quantize:"))
    return 0


def check_output_dir(source: Path, out: Path, *, force: bool) -> None:
    """Refuses an ``--out`` that would overwrite the source or land inside it."""
    if out == source or source in out.parents or out in source.parents:
        raise ValueError(
            f"--out {out} is the source checkpoint {source}, inside it or contains it; "
            "write the NVFP4 copy to a separate directory"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty; pass --force to replace it")


def modelopt_ignore_list(ignored_modules: tuple[str, ...]) -> list[str]:
    """ModelOpt ``ignore`` entries: lm_head (never quantized), each ignored
    projection, and a ``<block>*`` glob for every attention/MLP block whose
    projections are all ignored (MAX reads ignores per block)."""
    ignored = set(ignored_modules)
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
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": nvfp4.BLOCK_SIZE, "ignore": ignore}


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
        if path.is_file() and path.name not in _REWRITTEN and not path.name.endswith(_NOT_COPIED_SUFFIXES):
            shutil.copy2(path, staging / path.name)


register_subcommand(
    "quantize",
    "write an NVFP4 (ModelOpt layout) copy of a Hugging Face checkpoint",
    _add_quantize_arguments,
    run_quantize,
)
