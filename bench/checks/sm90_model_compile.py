"""Whether our Gemma model compiles for the H200 (sm_90a), and how long it takes, without a GPU.

    python bench/checks/sm90_model_compile.py CKPT_DIR [--make-checkpoint --layers 2]
        [--quant nvfp4|none] [--quant-ignore self_attn] [--max-builtin]
        [--prefer-module-v3] [--max-length 4096] [--no-capture] [--no-use-subgraphs]

Runs MAX's own compile-only path (what ``max warm-cache --target cuda:sm_90a``
does: virtual devices, the real compiler, no GPU) on a Gemma 3 or Gemma 4
checkpoint, in-process, with ``--custom-architectures attnquant``: the served pipeline
model, its load-time weight preparation (``ATTNQUANT_QUANT``, default nvfp4
everywhere; ``--quant-ignore self_attn`` keeps attention bf16) and its graph.
``--no-capture`` compiles without device graph capture (our row padding is
then ``fixed``, with no one-row branch). Decoder layers compile as one
subgraph per structure, the default; ``--no-use-subgraphs`` (MAX's flag) inlines
every one. ``--max-builtin`` (Gemma 4) leaves
attnquant out (MAX's own Gemma 4, graph API; add
``--prefer-module-v3`` for its ModuleV3 path); it first adds to
CKPT_DIR/config.json, as null, the MoE fields MAX reads and a
``gemma4_unified`` text config lacks. Prints, per graph compiled, OK or FAIL
with the compiler's constraint message and the compile time; then whether the
rest of pipeline construction (weight binding, KV cache, ...) went through.
In compile-only mode MAX hands back stand-in models, so a failure after the
compile is reported as "compiled; <what failed after>".

``--make-checkpoint`` first writes a random checkpoint at the 31B text
geometry into CKPT_DIR (``make_random_gemma4.py``'s config and writers) with
``--layers`` layers, any count: the last layer is full attention (heads of
512, k = v), the others follow the 5:1 pattern, so 2 layers cover both layer
kinds (4.8 GB on disk). Each compile takes minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "checks"))

from sm90_matmul_shapes import constraint, error_text  # noqa: E402

TARGET = "cuda:sm_90a"


def make_checkpoint(out: Path, layers: int) -> None:
    sys.path.insert(0, str(REPO / "bench" / "checkpoints"))
    import make_random_gemma4 as m

    out.mkdir(parents=True, exist_ok=True)
    config = m.build_config(layers)
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    types[-1] = "full_attention"
    config.text_config.layer_types = types
    config.architectures = ["Gemma4UnifiedForConditionalGeneration"]
    # As make_random_gemma4.main: fields MAX's graph-API Gemma 4 reads.
    config.text_config.vocab_size_per_layer_input = m.GEOMETRY_31B["vocab_size"]
    config.text_config.hidden_size_per_layer_input = 0
    config.text_config.enable_moe_block = False
    config.save_pretrained(out)
    total = m.write_weights(out, config)
    m.write_word_tokenizer(
        out, m.GEOMETRY_31B["vocab_size"], m.SPECIAL_TOKENS, m.CHAT_TEMPLATE, m.GEMMA_ROLES
    )
    print(f"wrote {out}: {layers} layers {types}, {total / 1e9:.1f} GB", flush=True)


# Text-config fields MAX's own Gemma 4 config reads that a transformers
# ``gemma4_unified`` text config lacks (ours fills them at load:
# models/gemma4/model_config.py); without them --max-builtin stops at
# "'Gemma4UnifiedTextConfig' object has no attribute 'num_experts'".
MAX_TEXT_FIELDS = {"num_experts": None, "top_k_experts": None, "moe_intermediate_size": None}


def add_max_text_fields(checkpoint: Path) -> None:
    import json

    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    missing = {k: v for k, v in MAX_TEXT_FIELDS.items() if k not in config["text_config"]}
    if missing:
        config["text_config"].update(missing)
        path.write_text(json.dumps(config, indent=2) + "\n")
        print(f"added {sorted(missing)} (absent) to {path}", flush=True)


class CompileLog:
    """Wraps ``InferenceSession.compile``: one record per graph compiled."""

    def __init__(self) -> None:
        self.records: list[tuple[str, float, BaseException | None]] = []

    def install(self) -> None:
        from max.engine import InferenceSession

        original = InferenceSession.compile
        log = self

        def compile(session, model, *args, **kwargs):  # noqa: ANN001, ANN202
            name = getattr(model, "name", None) or str(model)
            print(f"compiling graph {name} for {TARGET} ...", flush=True)
            start = time.time()
            try:
                result = original(session, model, *args, **kwargs)
            except BaseException as error:
                seconds = time.time() - start
                log.records.append((name, seconds, error))
                print(f"FAIL graph {name}: {seconds:.0f} s:\n{constraint(error)}", flush=True)
                raise
            seconds = time.time() - start
            log.records.append((name, seconds, None))
            print(f"OK   graph {name}: {seconds:.0f} s", flush=True)
            return result

        InferenceSession.compile = compile  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--make-checkpoint", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--quant", default="nvfp4", help="ATTNQUANT_QUANT (default nvfp4)")
    parser.add_argument("--quant-ignore", default="", help="ATTNQUANT_QUANT_IGNORE, e.g. self_attn")
    parser.add_argument("--max-builtin", action="store_true", help="MAX's own Gemma 4 (no attnquant)")
    parser.add_argument("--prefer-module-v3", action="store_true")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument(
        "--no-capture", action="store_true",
        help="without device graph capture (our row padding is then fixed, not a branch)",
    )  # fmt: skip
    parser.add_argument("--no-use-subgraphs", action="store_true", help="every decoder layer inlined")
    args = parser.parse_args()

    if args.make_checkpoint and not (args.checkpoint / "config.json").exists():
        make_checkpoint(args.checkpoint, args.layers)
    if args.max_builtin:
        add_max_text_fields(args.checkpoint)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    # The max CLI re-execs itself under jemalloc, which would drop CompileLog.
    os.environ["MODULAR_MAX_ALLOCATOR"] = "system"
    os.environ["ATTNQUANT_QUANT"] = args.quant
    os.environ["ATTNQUANT_QUANT_IGNORE"] = args.quant_ignore
    os.environ.setdefault("ATTNQUANT_CACHE_DIR", "/tmp/attnquant_sm90_compile_cache")

    variant = (
        "max-builtin" + (" module-v3" if args.prefer_module_v3 else "")
        if args.max_builtin
        else f"attnquant quant={args.quant} ignore={args.quant_ignore or '-'}"
    )
    max_args = [
        "warm-cache", "--target", TARGET, "--devices", "gpu:0",
        "--model-path", str(args.checkpoint.resolve()),
        "--quantization-encoding", "bfloat16",
        "--max-length", str(args.max_length), "--max-batch-size", "1",
    ]  # fmt: skip
    if not args.max_builtin:
        max_args += ["--custom-architectures", str(REPO / "attnquant")]
    if args.prefer_module_v3:
        max_args.append("--prefer-module-v3")
    if args.no_capture:
        max_args.append("--no-device-graph-capture")
    if args.no_use_subgraphs:
        max_args.append("--no-use-subgraphs")

    log = CompileLog()
    log.install()
    from max._entrypoints.pipelines import main as max_main

    print(f"[{variant}] max {' '.join(max_args)}", flush=True)
    sys.argv = ["max", *max_args]
    start = time.time()
    after: BaseException | None = None
    try:
        max_main(standalone_mode=False)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            after = exit_
    except BaseException as error:  # noqa: BLE001 - report whatever stopped it
        after = error
        traceback.print_exc()
    total = time.time() - start

    print(f"\n=== {variant}, {TARGET}, {args.checkpoint}: {total:.0f} s in all ===")
    failed = [r for r in log.records if r[2] is not None]
    for name, seconds, error in log.records:
        status = "OK  " if error is None else "FAIL"
        print(f"{status} compile {name}: {seconds:.0f} s")
    if failed:
        name, seconds, error = failed[0]
        print(f"RESULT FAIL: graph {name} did not compile ({seconds:.0f} s):\n{constraint(error)}")
        return 1
    if not log.records:
        print(f"RESULT FAIL before any compile: {error_text(after) if after else 'no graph compiled'}")
        return 1
    if after is not None:
        print(f"RESULT compiled; after the compile: {error_text(after)[-1500:]}")
        return 0
    print("RESULT OK: compiled, and MAX's compile-only pipeline construction completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
