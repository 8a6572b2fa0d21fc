"""``attnquant verify``: how far the configured model's predictions move.

Runs the unquantized model (the reference: the checkpoint's own weights) and
the configured one (``ATTNQUANT_*`` with the flags laid over it) over the same
windows of real text, and compares their full next-token distributions at
every position:

- KL(ref || quant) in nats per token: mean, median and 99th percentile;
- top-1 agreement: how often both put the same token first;
- perplexity of each on the text's actual next tokens, and their ratio;
- max |Δlogit| over every position and vocabulary entry.

Logits are exact full-vocabulary rows from either of two paths:

- ``--reference max`` (default): both models through our MAX architecture
  in-process, built by MAX's registry with ``enable_echo`` so the graph
  returns logits for every position (``ReturnLogits.ALL``): what we serve.
- ``--reference transformers``: both through transformers in float32, with
  the weights MAX would serve computed on the host (``precompute_outside``,
  NVFP4 dequantized): an independent cross-check.

Each window is BOS followed by the next ``window - 1`` tokens of the text, so
a window scores ``window - 1`` predictions; windows do not overlap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from attnquant.config import ENV_PREFIX, SETTINGS, AttnQuantConfig, choices_of
from attnquant.formats import nvfp4
from attnquant.formats.names import find_projections
from attnquant.load.checkpoint import load_state_dict, read_config
from attnquant.tools.cli import add_weight_flags, register_subcommand, with_weight_flags
from attnquant.tools.corpus import Text, load_text

DEFAULT_TOKENS = 20_000
DEFAULT_WINDOW = 512
MAX_WINDOW = 1024
"""MAX's planned max length (windows must be shorter). Fixed, so that --window
never changes what MAX compiles."""

# Rows of a window handled at once in float64: 64 x 262k vocab x 8 B = 134 MB.
_ROWS_PER_CHUNK = 64

LogitSource = Callable[[Sequence[int]], torch.Tensor]
"""A window of token ids -> float32 logits [len(window), vocab], one row per position."""


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityReport:
    """What ``attnquant verify`` prints; field names are the ``--json`` keys."""

    kl_mean: float
    kl_median: float
    kl_p99: float
    top1_agreement: float  # percent
    ppl_ref: float
    ppl_quant: float
    max_abs_logit_diff: float
    tokens: int

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_quant / self.ppl_ref

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def lines(self) -> list[str]:
        return [
            f"KL(ref || quant), nats/token: mean {self.kl_mean:.6f}  "
            f"median {self.kl_median:.6f}  p99 {self.kl_p99:.6f}",
            f"top-1 agreement: {self.top1_agreement:.2f} %",
            f"perplexity: ref {self.ppl_ref:.4f}  quant {self.ppl_quant:.4f}  "
            f"ratio {self.ppl_ratio:.4f}",
            f"max |Δlogit|: {self.max_abs_logit_diff:.4f}",
            f"tokens scored: {self.tokens}",
        ]


class Comparison:
    """Running per-position statistics of two models over scored positions."""

    def __init__(self) -> None:
        self._kl: list[torch.Tensor] = []
        self._agree = 0
        self._nll_ref = 0.0
        self._nll_quant = 0.0
        self._max_diff = 0.0
        self._count = 0

    def add(self, ref: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor) -> None:
        """Adds positions: logits [T, V] of each model and the true next tokens [T]."""
        if ref.shape != quant.shape or ref.shape[0] != targets.shape[0]:
            raise ValueError(
                f"logit shapes differ: ref {tuple(ref.shape)}, quant {tuple(quant.shape)}, "
                f"targets {tuple(targets.shape)}"
            )
        for start in range(0, ref.shape[0], _ROWS_PER_CHUNK):
            rows = slice(start, start + _ROWS_PER_CHUNK)
            self._add_chunk(ref[rows], quant[rows], targets[rows])

    def _add_chunk(self, ref: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor) -> None:
        # float64, so that KL of nearly equal distributions is not rounding noise.
        log_p = torch.log_softmax(ref.double(), dim=-1)
        log_q = torch.log_softmax(quant.double(), dim=-1)
        self._kl.append((log_p.exp() * (log_p - log_q)).sum(dim=-1))
        self._agree += int((ref.argmax(dim=-1) == quant.argmax(dim=-1)).sum())
        picked = targets[:, None].long()
        self._nll_ref -= float(log_p.gather(1, picked).sum())
        self._nll_quant -= float(log_q.gather(1, picked).sum())
        # float32 is enough here: one rounding of the difference, and none when equal.
        self._max_diff = max(self._max_diff, float((ref - quant).abs().max()))
        self._count += targets.shape[0]

    def report(self) -> QualityReport:
        if not self._count:
            raise ValueError("no positions were scored")
        kl = torch.cat(self._kl)
        return QualityReport(
            kl_mean=float(kl.mean()),
            kl_median=float(torch.quantile(kl, 0.5)),
            kl_p99=float(torch.quantile(kl, 0.99)),
            top1_agreement=100.0 * self._agree / self._count,
            ppl_ref=math.exp(self._nll_ref / self._count),
            ppl_quant=math.exp(self._nll_quant / self._count),
            max_abs_logit_diff=self._max_diff,
            tokens=self._count,
        )


def token_windows(ids: Sequence[int], *, bos: int, window: int, tokens: int) -> list[list[int]]:
    """Non-overlapping windows of ``[bos, *next window-1 text tokens]`` that
    together score exactly ``tokens`` predictions (the last may be shorter)."""
    if window < 2:
        raise ValueError(f"--window must be at least 2, got {window}")
    if tokens < 1:
        raise ValueError(f"--tokens must be at least 1, got {tokens}")
    if tokens > len(ids):
        raise ValueError(f"--tokens {tokens} is more than the text has ({len(ids)})")
    step = window - 1
    starts = range(0, tokens, step)
    return [[bos, *ids[start : min(start + step, tokens)]] for start in starts]


def compare(
    reference: LogitSource,
    candidate: LogitSource,
    windows: Sequence[Sequence[int]],
    *,
    progress: bool = False,
) -> QualityReport:
    """Scores every window: position i predicts token i + 1, from BOS's
    prediction of the first text token to the prediction of the window's last
    token (the last position's prediction has no target and is dropped)."""
    comparison = Comparison()
    for window in tqdm(windows, desc="attnquant verify", unit="window", disable=not progress):
        targets = torch.tensor(window[1:])
        comparison.add(reference(window)[:-1], candidate(window)[:-1], targets)
    return comparison.report()


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------


def reference_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without any setting that changes weights: the checkpoint's own."""
    weight_vars = {setting.env for setting in SETTINGS if setting.changes_weights}
    return {name: value for name, value in env.items() if name not in weight_vars}


def candidate_env(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the flags given laid over it (as ``attnquant quantize`` does)."""
    return {**with_weight_flags(args, env), "ATTNQUANT_QUANT": args.quant}


@contextmanager
def _attnquant_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Runs the block with exactly ``env``'s ATTNQUANT_* variables set (our MAX
    architecture reads them from the environment at load); others untouched."""
    saved = {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}
    for name in saved:
        del os.environ[name]
    os.environ.update({name: value for name, value in env.items() if name.startswith(ENV_PREFIX)})
    try:
        yield
    finally:
        for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
            del os.environ[name]
        os.environ.update(saved)


# ---------------------------------------------------------------------------
# Logit sources
# ---------------------------------------------------------------------------


def host_weights(served: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A served state dict as float32 tensors, NVFP4 projections dequantized."""
    weights = {}
    for name, tensor in served.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.weight_scale" in served:
            packed = nvfp4.NVFP4Weight(
                tensor, served[f"{module}.weight_scale"], served[f"{module}.weight_scale_2"]
            )
            weights[name] = nvfp4.dequantize(packed)
        elif not name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            weights[name] = tensor.float()
    return weights


# A text + vision Gemma 3 checkpoint's file names (Google's layout, and what
# transformers 5.12's save_pretrained writes: vision_tower.* without
# vision_model.) -> the names of transformers 5's module tree.
_MULTIMODAL_FILE_NAMES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def module_names(checkpoint: Mapping[str, torch.Tensor], known: Collection[str]) -> dict[str, torch.Tensor]:
    """``checkpoint``'s tensors under the transformers model's own names
    (``known``): a name the model has stays, a text + vision checkpoint's
    file layout is renamed."""
    renamed = {}
    for name, tensor in checkpoint.items():
        if name not in known:
            for before, after in _MULTIMODAL_FILE_NAMES:
                if name.startswith(before):
                    name = after + name[len(before) :]
                    break
        renamed[name] = tensor
    return renamed


def transformers_model(
    model_dir: Path, env: Mapping[str, str], *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Any:
    """transformers' model of ``model_dir`` holding the weights MAX serves under
    ``env`` (computed on the host, NVFP4 dequantized; an NVFP4 output head
    unties the head from the embedding, as ours does), in ``dtype`` on ``device``.

    A text + vision checkpoint (``Gemma3ForConditionalGeneration``) gives
    that class, whose text-only forward and ``generate`` are the reference
    for our language model; its vision tower keeps the checkpoint's weights.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from attnquant.load import importance
    from attnquant.load.head import OutputHead
    from attnquant.load.precompute import precompute_outside

    transformers_logging.disable_progress_bar()

    config = AttnQuantConfig.from_env(env)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied = bool(model.config.get_text_config().tie_word_embeddings)
    parameters = model.state_dict(keep_vars=True)
    embedding = next(
        name for name, t in parameters.items() if t is model.get_input_embeddings().weight and "lm_head" not in name
    )
    head = OutputHead("lm_head", embedding, tied=tied)
    checkpoint = module_names(load_state_dict(model_dir), parameters.keys())
    importances = importance.for_quantization(
        checkpoint, find_projections(checkpoint), config, importance.for_checkpoint_config(read_config(model_dir)),
        embedding=head.embedding, head=head.weight_name if config.lm_head == "nvfp4" else None,
    )  # fmt: skip
    served = precompute_outside(checkpoint, config, head=head, importance=importances, progress=False).state_dict
    del checkpoint
    weights = host_weights(served)
    del served
    if tied and "lm_head.weight" in weights:  # an NVFP4 head of its own
        model.lm_head.weight = torch.nn.Parameter(weights.pop("lm_head.weight"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # A tied lm_head is the embedding, so the checkpoint has none.
    if unexpected or any("lm_head" not in name for name in missing):
        raise ValueError(f"{model_dir}: weights do not fit: missing {missing}, unexpected {unexpected}")
    return model.to(device, dtype).eval()


def transformers_source(
    model_dir: Path,
    env: Mapping[str, str],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LogitSource:
    """:func:`transformers_model`'s logits (float32 on the CPU unless told
    otherwise: ``bench/checks/ingraph_paths_max.py`` also runs it in bfloat16
    on the accelerator, as a yardstick for MAX's bf16 logits)."""
    model = transformers_model(model_dir, env, device=device, dtype=dtype)

    @torch.no_grad()
    def logits(window: Sequence[int]) -> torch.Tensor:
        return model(torch.tensor([list(window)], device=device)).logits[0].float().cpu()

    return logits


class MaxSource:
    """Full logits from our MAX architecture, in this process.

    MAX's registry builds the same pipeline ``max serve`` does, with
    ``enable_echo`` on: the model then returns logits for every position.
    Each window claims KV cache, runs one prefill and releases it.
    ``gpu=True`` runs it on the first accelerator in bfloat16 (the served
    dtype) instead of on the CPU in float32. ``builtin=True`` builds MAX's
    own architecture for the checkpoint instead of ours (a diagnostic: it
    serves the checkpoint's weights and ignores ``ATTNQUANT_*``). Build it
    before any of ours in the process: once ours is registered, it answers
    for the architecture's name.
    """

    def __init__(
        self, model_dir: Path, env: Mapping[str, str], *, gpu: bool = False, builtin: bool = False
    ) -> None:
        from max.driver import DeviceSpec
        from max.pipelines import PIPELINE_REGISTRY, PipelineArgs, PipelineConfig

        import attnquant

        # The "<dir>/attnquant" form, as run_max.py passes it.
        ours = [] if builtin else [str(Path(attnquant.__file__).resolve().parent)]
        args = PipelineArgs.from_flat_kwargs(
            model_path=str(model_dir),
            custom_architectures=ours,
            device_specs=[DeviceSpec.accelerator() if gpu else DeviceSpec.cpu()],
            quantization_encoding="bfloat16" if gpu else "float32",
            enable_echo=True,
            enable_prefix_caching=False,  # every window is computed, none reused
            max_batch_size=1,
            max_length=MAX_WINDOW,
        )
        with _attnquant_environ(env):
            _, self._pipeline = PIPELINE_REGISTRY.retrieve(PipelineConfig.from_args(args))

    def __call__(self, window: Sequence[int]) -> torch.Tensor:
        import numpy as np
        from max.driver import CPU
        from max.pipelines.context import EOSTracker, SamplingParams, TextContext, TokenBuffer
        from max.pipelines.modeling.types import RequestID

        pipeline = self._pipeline
        context = TextContext(
            request_id=RequestID(),
            max_length=len(window) + 1,
            tokens=TokenBuffer(np.asarray(window, dtype=np.int64)),
            eos_tracker=EOSTracker(eos_token_ids=set()),
            sampling_params=SamplingParams(),
        )
        pipeline.kv_manager.claim(context)
        try:
            pipeline.kv_manager.alloc(context).synchronize()
            inputs, _, _ = pipeline.prepare_batch([[context]])
            # The pipeline model itself, not pipeline.execute: execute samples
            # and hands logits processors only the last row.
            outputs = pipeline._pipeline_model.execute(inputs)
            # To the host (a GPU run's logits are on the device), as float32, copied.
            return torch.from_dlpack(outputs.logits.to(CPU())).to(torch.float32, copy=True)
        finally:
            pipeline.kv_manager.release(context)
            pipeline.release(context.request_id)


def logit_source(path: str, model_dir: Path, env: Mapping[str, str], device: str = "cpu") -> LogitSource:
    """Logits from ``path`` (``max`` or ``transformers``) on ``device``: the CPU
    in float32, or the first GPU in bfloat16, the served dtype."""
    gpu = device == "gpu"
    if path == "max":
        return MaxSource(model_dir, env, gpu=gpu)
    if path == "transformers":
        return transformers_source(
            model_dir, env, device="cuda" if gpu else "cpu", dtype=torch.bfloat16 if gpu else torch.float32
        )
    raise ValueError(f"--reference must be max or transformers, not {path!r}")


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    report: QualityReport
    description: str
    seconds_load: float
    seconds_run: float


def text_windows(model_dir: Path, text: Text, *, window: int, tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text.body, add_special_tokens=False).input_ids
    if tokenizer.bos_token_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has no BOS token")
    return token_windows(ids, bos=tokenizer.bos_token_id, window=window, tokens=tokens)


def measure(args: argparse.Namespace, env: Mapping[str, str]) -> Measurement:
    model_dir = _model_dir(args.model_dir)
    if args.reference == "max" and args.window >= MAX_WINDOW:
        raise ValueError(f"--window must be below {MAX_WINDOW} with --reference max")
    cand_env = candidate_env(args, env)
    candidate_config = AttnQuantConfig.from_env(cand_env)  # bad values fail before loading
    windows = text_windows(model_dir, load_text(args.text), window=args.window, tokens=args.tokens)
    start = time.monotonic()
    if args.reference == "max":
        _say("building both models in MAX (a graph not compiled before takes minutes)")
    reference = logit_source(args.reference, model_dir, reference_env(env), args.device)
    candidate = logit_source(args.reference, model_dir, cand_env, args.device)
    loaded = time.monotonic()
    report = compare(reference, candidate, windows, progress=not args.no_progress)
    description = (
        f"{model_dir}: {candidate_config.describe(weights_only=True)} vs unquantized; "
        f"{args.reference} logits on {'the GPU, bfloat16' if args.device == 'gpu' else 'the CPU, float32'}; "
        f"{len(windows)} windows of <= {args.window} tokens"
    )
    return Measurement(report, description, loaded - start, time.monotonic() - loaded)


def _say(message: str) -> None:
    print(f"attnquant verify: {message}", file=sys.stderr, flush=True)


def _model_dir(given: Path | None) -> Path:
    if given is not None:
        return given
    from attnquant.tools.demo_model import ensure_demo_model

    return ensure_demo_model()


def run_verify(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    result = measure(args, dict(os.environ))
    timing = f"loaded in {result.seconds_load:.1f}s, measured in {result.seconds_run:.1f}s"
    if args.json:
        print(result.report.to_json())
        print(f"attnquant verify: {result.description}; {timing}", file=sys.stderr)
    else:
        print(f"attnquant verify: {result.description}")
        for line in result.report.lines():
            print(f"  {line}")
        print(f"  {timing}")
    return 0


def _add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", type=Path, nargs="?", default=None, metavar="MODEL_DIR",
        help="Hugging Face Gemma 3 checkpoint (default: the embedded Gemma 3 270M)",
    )
    parser.add_argument(
        "--quant", choices=choices_of("ATTNQUANT_QUANT"), default="nvfp4",
        help="the configured model's quantization (ATTNQUANT_QUANT; default nvfp4)",
    )
    add_weight_flags(parser)
    parser.add_argument(
        "--text", type=Path, default=None, metavar="FILE",
        help="UTF-8 text to measure on (default: the bundled public-domain novel Botchan)",
    )
    parser.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
        help=f"predictions to score, from the start of the text (default {DEFAULT_TOKENS})",
    )
    parser.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, metavar="W",
        help=f"tokens per window, BOS included (default {DEFAULT_WINDOW})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu",
        help="where both models run: the CPU in float32 (default) or the first GPU in bfloat16",
    )
    parser.add_argument(
        "--reference", choices=("max", "transformers"), default="max",
        help="where both models run: our MAX architecture (default) or transformers float32",
    )  # fmt: skip


register_subcommand(
    "verify",
    "compare the configured model's next-token distributions with the unquantized model's",
    _add_verify_arguments,
    run_verify,
)
