"""MAX's command line with attnquant's defaults (behind ``run_max.py``).

``python run_max.py serve|generate [max args]`` or
``python -m attnquant.tools.max_cli serve|generate [max args]``: a thin wrapper over
MAX's own CLI. Before MAX starts it checks, each in one line with the fix:

- every ``ATTNQUANT_*`` setting (a bad value or an unknown name);
- a local ``--model-path``: its architecture is one attnquant serves, and its
  safetensors files are whole.

Then it adds only what attnquant needs and passes every other argument to
MAX unchanged:

- ``--custom-architectures attnquant`` (our Gemma 3 / Gemma 4 replace MAX's);
- ``--model-path`` defaults to the embedded real Gemma 3 270M;
- ``--enable-in-flight-batching`` for ``serve`` (prefill joins decode batches);
- on a machine without a GPU (or with ``--devices cpu``):
  ``--quantization-encoding float32``, since MAX refuses bfloat16 on CPU, and
  for ``serve`` ``--max-batch-size`` (half the cores, 2 to 8) and
  ``--max-length 8192``: MAX would otherwise serve one request at a time on
  CPU, and KV cache for that many sequences stays a few GiB;
- ``HF_HUB_OFFLINE=1`` and ``MAX_SERVE_DISABLE_TELEMETRY=1`` unless already set.

An argument you pass yourself always wins over the one it would add.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from attnquant.config import AttnQuantConfig

COMMANDS = ("serve", "generate")
CPU_MAX_LENGTH = 8192


def _has_flag(args: Sequence[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def _flag_value(args: Sequence[str], *flags: str) -> str | None:
    for i, arg in enumerate(args):
        for flag in flags:
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
    return None


def _runs_on_cpu(args: Sequence[str]) -> bool:
    devices = _flag_value(args, "--devices")
    if devices is not None:
        return devices.startswith("cpu")
    from max.driver import accelerator_count

    return accelerator_count() == 0


def _package_dir() -> Path:
    import attnquant

    return Path(attnquant.__file__).resolve().parent


def cpu_batch_size(cores: int | None = None) -> int:
    """``--max-batch-size`` on CPU: half the cores, at least 2, at most 8."""
    return min(max((cores or os.cpu_count() or 2) // 2, 2), 8)


def max_arguments(command: str, args: Sequence[str]) -> list[str]:
    """The MAX argument list for ``command`` with attnquant's defaults added."""
    if command not in COMMANDS:
        raise SystemExit(f"usage: run_max.py {{{','.join(COMMANDS)}}} [max args]; got {command!r}")
    out = [command, *args]
    if not _has_flag(args, "--custom-architectures"):
        # The "<dir>/attnquant" form makes MAX put <dir> on sys.path in every
        # process it starts (serve's model worker too), checkout or install.
        out += ["--custom-architectures", str(_package_dir())]
    if not _has_flag(args, "--model-path", "--model"):
        from attnquant.tools.demo_model import ensure_demo_model

        out += ["--model-path", str(ensure_demo_model())]
    if command == "serve" and not _has_flag(args, "--enable-in-flight-batching", "--no-enable-in-flight-batching"):
        out.append("--enable-in-flight-batching")
    if not _has_flag(args, "--quantization-encoding") and _runs_on_cpu(args):
        out += ["--quantization-encoding", "float32"]
        if not _has_flag(args, "--devices"):
            out += ["--devices", "cpu"]
        if command == "serve" and not _has_flag(args, "--max-batch-size"):
            out += ["--max-batch-size", str(cpu_batch_size())]
        if command == "serve" and not _has_flag(args, "--max-length"):
            out += ["--max-length", str(CPU_MAX_LENGTH)]
    return out


def check_model(model_path: Path, config: AttnQuantConfig) -> None:
    """Refuses, before MAX starts, a local checkpoint attnquant does not serve,
    whose weight files are damaged, or that no ``ATTNQUANT_QUANT_IGNORE``
    fragment fits.

    Raises:
        ValueError: naming the architecture (and what attnquant serves), the
            file or the fragment.
    """
    from attnquant.load.checkpoint import read_config
    from attnquant.load.memory import check_before_serving

    architectures = read_config(model_path).get("architectures") or ["(none in config.json)"]
    served = served_architectures()
    if architectures[0] not in served:
        raise ValueError(
            f"{model_path} is a {architectures[0]} checkpoint; attnquant serves {', '.join(sorted(served))}. "
            "Serve it with MAX's own architecture (plain `max serve`, without --custom-architectures attnquant)"
        )
    check_before_serving(model_path, config)


def served_architectures() -> tuple[str, ...]:
    """The ``architectures`` names of the checkpoints our registrations serve."""
    import attnquant

    return attnquant.SERVED_CHECKPOINTS


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    try:
        config = AttnQuantConfig.from_env()
        model_path = _flag_value(argv[1:], "--model-path", "--model")
        if model_path is not None and Path(model_path).is_dir():
            check_model(Path(model_path), config)
    except ValueError as error:
        print(f"attnquant: error: {error}", file=sys.stderr)
        return 2
    # MAX's own `max` entry point, with our arguments.
    from max._entrypoints.pipelines import main as max_main

    sys.argv = ["max", *max_arguments(argv[0], argv[1:])]
    return max_main()


if __name__ == "__main__":
    sys.exit(main())
