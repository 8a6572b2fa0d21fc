"""Our Gemma 4 on MAX, CPU: registration, refusals, and real serving of a tiny model.

The served model is ``tests/gemma4_fixtures.py``'s random Gemma 4 (text-only
"unified" line; full-attention layers with their own head size and no
``v_proj``). One ``max serve`` per configuration, shared by its tests (each
distinct graph costs minutes to compile on 2 cores): passthrough, and NVFP4
everywhere but one attention projection (``ATTNQUANT_QUANT_IGNORE``, which
also makes that layer's q|k a mixed dense + NVFP4 group). The host reference
is transformers in float32 with the weights MAX serves (dequantized where
they are NVFP4).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnquant.formats import nvfp4
from attnquant.formats.names import find_projections
from attnquant.load import importance
from attnquant.load.checkpoint import load_state_dict
from attnquant.config import LOGGER_NAME, AttnQuantConfig
from attnquant.load.precompute import precompute_outside

from .gemma4_fixtures import (
    LAYER_TYPES,
    TINY_GEMMA4_TEXT,
    expected_projection_count,
    write_tiny_gemma4,
)
from .serving import REPO, Server, assert_greedy_matches_reference, start_server

pytestmark = pytest.mark.max

PROMPTS = ("The capital of France is", "Once upon a time")
NEW_TOKENS = 10
ATOL = 2e-3  # MAX vs transformers, both float32, same weights
IGNORED = "layers.3.self_attn.q_proj"
CONFIGS = {
    "passthrough": {"ATTNQUANT_QUANT": "none"},
    "nvfp4": {"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_QUANT_IGNORE": IGNORED},
}
BASE_NAMES = ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")


@pytest.fixture(scope="session")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma4(tmp_path_factory.mktemp("tiny_gemma4"))


@pytest.fixture(scope="session")
def custom_architectures() -> None:
    """MAX's global lookup with attnquant imported, as ``--custom-architectures`` does."""
    from max.pipelines.lib.arch_lookup import ARCH_LOOKUP

    ARCH_LOOKUP.import_custom_architectures([str(REPO / "attnquant")])


# --- registration: which implementation MAX resolves (no compile) -----------


def _resolve(name: str, prefer_module_v3: bool = False):
    from max.pipelines.lib.arch_lookup import find_architecture

    arch = find_architecture(name, prefer_module_v3=prefer_module_v3)
    assert arch is not None, name
    return arch


@pytest.mark.parametrize("prefer_module_v3", [False, True])
@pytest.mark.parametrize("name", BASE_NAMES)
def test_base_names_resolve_to_ours(custom_architectures, name: str, prefer_module_v3: bool) -> None:
    from models.gemma4.model import AttnQuantGemma4Model

    assert _resolve(name, prefer_module_v3).pipeline_model is AttnQuantGemma4Model


# --- device graph capture: the buffer ABI (no compile) -----------------------


def test_capture_buffers_follow_the_compiled_call_order() -> None:
    """``buffers`` lists exactly what MAX's ``Gemma4Model.execute`` passes to
    the compiled language tower, in its order: capture replays with
    ``model(*inputs.buffers)``, so a slip here feeds the wrong tensors."""
    import inspect
    import re

    from max.pipelines.architectures.gemma4_modulev3.inputs import Gemma4Inputs
    from max.pipelines.architectures.gemma4_modulev3.model import Gemma4Model

    from models.gemma4.inputs import AttnQuantGemma4Inputs

    assert "buffers" not in Gemma4Inputs.__dict__  # MAX's: no ABI, so ours is needed
    call = re.search(r"self\.language_model\((.*?)\n\s*\)", inspect.getsource(Gemma4Model.execute), re.S)
    assert call, "MAX's Gemma4Model.execute no longer calls self.language_model(...)"
    args = [a.strip().removeprefix("model_inputs.") for a in call.group(1).split(",") if a.strip()]
    assert args == [
        "tokens", "return_n_logits", "input_row_offsets",
        "vision_embeddings[0]", "vision_scatter_indices[0]", "*tree.leaves(kv_cache_inputs)",
    ]  # fmt: skip
    kv = {"a": "kv0", "b": ["kv1", "kv2"]}
    inputs = AttnQuantGemma4Inputs(
        tokens="tokens", input_row_offsets="offsets", return_n_logits="n", kv_cache_inputs=kv
    )
    inputs.vision_embeddings, inputs.vision_scatter_indices = ["embeddings"], ["indices"]
    assert inputs.buffers == ("tokens", "n", "offsets", "embeddings", "indices", "kv0", "kv1", "kv2")


def test_capture_is_declared_and_the_removed_switch_is_refused() -> None:
    """Our Gemma 4 text architectures declare capture (MAX then captures by
    default; --no-device-graph-capture turns it off); the MTP target keeps
    MAX's setting. The old ATTNQUANT_GEMMA4_GRAPH_CAPTURE is an error that
    says what to do instead, and nothing is read at import time."""
    from max.pipelines.architectures.unified_mtp_gemma4_modulev3.arch import unified_mtp_gemma4_modulev3_arch as mtp

    from attnquant.config import AttnQuantConfig
    from models.gemma4.arch import gemma4_arch, gemma4_mtp_arch, gemma4_unified_arch
    from models.gemma4.inputs import AttnQuantGemma4BatchProcessor

    assert gemma4_arch.batching is gemma4_unified_arch.batching is AttnQuantGemma4BatchProcessor
    assert gemma4_arch.supports_device_graph_capture and gemma4_unified_arch.supports_device_graph_capture
    assert gemma4_mtp_arch.supports_device_graph_capture == mtp.supports_device_graph_capture
    with pytest.raises(ValueError, match="ATTNQUANT_GEMMA4_GRAPH_CAPTURE was removed.*--no-device-graph-capture"):
        AttnQuantConfig.from_env({"ATTNQUANT_GEMMA4_GRAPH_CAPTURE": "0"})


def _speculative_target(target: str, drafter: str, method: str) -> str:
    """The name MAX's own config resolution rewrites ``target`` to for this drafter."""
    from max.pipelines.lib.config.config import _apply_speculative_target_architecture
    from max.pipelines.speculative import SpeculativeConfig

    def model(arch: str) -> SimpleNamespace:
        return SimpleNamespace(huggingface_config=SimpleNamespace(architectures=[arch]))

    models = {"main": model(target), "draft": model(drafter)}
    _apply_speculative_target_architecture(
        SpeculativeConfig(speculative_method=method, num_speculative_tokens=2), models
    )
    return models["main"].huggingface_config.architectures[0]


def test_assistant_drafter_resolves_to_our_mtp_model(custom_architectures) -> None:
    from models.gemma4.speculative import AttnQuantUnifiedMTPGemma4Model

    name = _speculative_target("Gemma4ForConditionalGeneration", "Gemma4AssistantForCausalLM", "mtp")
    assert name == "UnifiedMTPGemma4ForCausalLM"
    for prefer_module_v3 in (False, True):
        assert _resolve(name, prefer_module_v3).pipeline_model is AttnQuantUnifiedMTPGemma4Model


@pytest.mark.parametrize(
    "target, drafter, method",
    [
        ("Gemma4ForConditionalGeneration", "DSparkDraftModel", "dspark"),
        ("Gemma4ForConditionalGeneration", "DFlashDraftModel", "dflash"),
        ("Gemma4UnifiedForConditionalGeneration", "Gemma4DSparkModel", "dspark"),
    ],
)
def test_other_drafters_resolve_to_a_clear_refusal(custom_architectures, target, drafter, method) -> None:
    from models.gemma4.speculative import REFUSED_TARGETS, RefusedDrafterConfig

    name = _speculative_target(target, drafter, method)
    assert name in REFUSED_TARGETS
    arch = _resolve(name)
    pipeline = SimpleNamespace(
        draft_model=SimpleNamespace(huggingface_config=SimpleNamespace(architectures=[drafter]))
    )
    assert arch.config is RefusedDrafterConfig
    with pytest.raises(ValueError, match=f"cannot serve Gemma 4 with a {drafter} drafter"):
        arch.config.initialize_from_config(pipeline, SimpleNamespace(), max_seq_len=512)


# --- bad input: refused with a clear error, before any compile ---------------


def _hf_config(**text):
    from transformers import Gemma4Config

    dense = dict(hidden_size_per_layer_input=0, num_hidden_layers=2)
    return Gemma4Config(text_config={**dense, **text})


@pytest.mark.parametrize(
    "text, quantization, expected",
    [
        (dict(enable_moe_block=True, num_experts=8, top_k_experts=2), None, "enable_moe_block=True, num_experts=8"),
        (dict(hidden_size_per_layer_input=256), None, "hidden_size_per_layer_input=256"),
        (dict(num_kv_shared_layers=1), None, "num_kv_shared_layers=1"),
        ({}, {"quant_method": "modelopt"}, r"quantization_config modelopt/\?: attnquant serves bf16"),
        ({}, {"quant_method": "gptq"}, r"quantization_config gptq/\?"),
    ],
)
def test_unsupported_configs_are_named(text, quantization, expected) -> None:
    from models.gemma4.model_config import check_supported

    config = _hf_config(**text)
    if quantization:
        config.quantization_config = quantization
    with pytest.raises(ValueError, match=f"does not serve this Gemma 4 checkpoint: .*{expected}"):
        check_supported(config)
    check_supported(_hf_config())  # the dense text config passes


def test_unified_text_config_gets_the_fields_max_reads() -> None:
    """transformers' gemma4_unified text config lacks fields MAX's config reads."""
    from transformers import Gemma4UnifiedConfig

    from models.gemma4.model_config import check_supported, fill_unified_text_defaults

    config = Gemma4UnifiedConfig(text_config=TINY_GEMMA4_TEXT)
    assert not hasattr(config.text_config, "hidden_size_per_layer_input")  # why the shim exists
    fill_unified_text_defaults(config.text_config)
    assert config.text_config.hidden_size_per_layer_input == 0
    assert config.text_config.enable_moe_block is False
    check_supported(config)


def test_unsupported_tensors_are_named() -> None:
    from models.gemma4.weight_adapters import check_language_tensors, unsupported_tensors

    dense = [
        "language_model.embed_tokens.weight",
        "language_model.layers.0.self_attn.q_proj.weight",
        "language_model.layers.0.self_attn.k_norm.weight",
        "language_model.layers.0.mlp.down_proj.weight",
        "language_model.layers.0.pre_feedforward_layernorm.weight",
        "language_model.layers.0.layer_scalar",
    ]
    assert unsupported_tensors(dense) == []
    moe = "language_model.layers.0.moe_block.experts.3.gate_proj.weight"
    with pytest.raises(ValueError, match=r"1 tensors .*moe_block\.experts\.3\.gate_proj"):
        check_language_tensors([*dense, moe])


def test_moe_checkpoint_fails_fast_through_max(gemma4_dir: Path, tmp_path: Path) -> None:
    """The real CLI: a MoE config stops at config time with our message, no compile."""
    moe_dir = tmp_path / "moe"
    shutil.copytree(gemma4_dir, moe_dir)
    config = json.loads((moe_dir / "config.json").read_text())
    config["text_config"].update(enable_moe_block=True, num_experts=4, top_k_experts=2)
    (moe_dir / "config.json").write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, str(REPO / "run_max.py"), "generate", "--model-path", str(moe_dir),
         "--prompt", "hi", "--max-new-tokens", "1", "--max-length", "512"],
        capture_output=True, text=True, timeout=300, env=os.environ,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-2000:]
    assert "does not serve this Gemma 4 checkpoint: enable_moe_block=True, num_experts=4" in output
    assert "compiling" not in output.lower()


# --- the load-time plan and the module tree it builds (no compile) ------------


@pytest.mark.parametrize("env", [CONFIGS["nvfp4"], CONFIGS["passthrough"], {"ATTNQUANT_QUANT": "nvfp4"}])
def test_memory_estimate_is_the_served_bytes(gemma4_dir: Path, env: dict[str, str]) -> None:
    """The weight size our memory planners give MAX (checkpoint files less
    what NVFP4 saves, from the headers only) is what load time serves."""
    from attnquant.load.memory import quantization_saving
    from attnquant.formats.nvfp4 import served_nbytes

    checkpoint = load_state_dict(gemma4_dir)
    config = AttnQuantConfig.from_env(env)
    served = precompute_outside(checkpoint, config, progress=False).state_dict
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    saving = quantization_saving(gemma4_dir, config)
    assert nbytes(checkpoint.values()) - saving == nbytes(served.values())
    assert (saving > 0) == (config.quant == "nvfp4")
    assert served_nbytes(8, 32) == 8 * 16 + 8 * 2 + 8


def test_memory_estimate_counts_what_the_graph_fold_keeps(gemma4_dir: Path) -> None:
    """The graph fold holds theta and the W_eff MAX folds from it at load: the
    estimate adds the projections' bytes once more; the GEMM path adds none."""
    from attnquant.load.memory import served_weights_size
    from attnquant.formats.names import ProjectionKey

    checkpoint = load_state_dict(gemma4_dir)
    projections = sum(t.numel() * t.element_size() for k, t in checkpoint.items() if ProjectionKey.parse(k))
    in_graph = {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0"}
    fold = AttnQuantConfig.from_env({**in_graph, "ATTNQUANT_PRECOMPUTE": "1"})
    gemm = AttnQuantConfig.from_env({**in_graph, "ATTNQUANT_GEMM": "1"})
    assert projections > 0
    assert served_weights_size(10**9, gemma4_dir, fold) == 10**9 + projections
    assert served_weights_size(10**9, gemma4_dir, gemm) == 10**9


def test_plan_counts_exactly_the_checkpoint_projections(gemma4_dir: Path) -> None:
    from attnquant.load.fuse import to_runtime_layout
    from models.gemma4.model import describe_projections

    state = load_state_dict(gemma4_dir)
    served = precompute_outside(state, AttnQuantConfig.from_env({}), progress=False)
    assert len(find_projections(state)) == expected_projection_count() == 26
    _, plan = to_runtime_layout(served.state_dict, fuse=True, dtype=torch.float32)
    for i, layer_type in enumerate(LAYER_TYPES):
        (qkv,) = plan[f"model.language_model.layers.{i}.self_attn.qkv_proj"]
        shared_kv = layer_type == "full_attention"
        assert qkv.members == (("q_proj", "k_proj") if shared_kv else ("q_proj", "k_proj", "v_proj"))
        assert qkv.out_dims == ((128, 32) if shared_kv else (64, 32, 32))
    line = describe_projections(plan, LAYER_TYPES)
    assert line.startswith("attnquant gemma4: 26 projections in 4 layers (2 sliding, 2 full attention)")
    assert "2 layers share k and v (attention_k_eq_v, no v_proj): [1, 3]" in line


def test_mtp_target_takes_the_served_weights(
    custom_architectures, gemma4_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MTP target (a ``Gemma4TextModel``) after ``use_projections`` declares
    exactly the tensors we serve it, NVFP4 and a mixed q|k group included;
    MAX's compile binds by these names, so a mismatch is a load failure (MTP
    needs a GPU, so this is as far as a CPU test goes without compiling)."""
    from max.driver import CPU
    from max.experimental import functional as F
    from max.experimental.tensor import default_device, default_dtype
    from max.pipelines.architectures.unified_mtp_gemma4_modulev3.unified_mtp_gemma4_modulev3 import (
        UnifiedMTPGemma4ModuleV3Target,
    )

    from models.common.layer_subgraphs import choose_layer_subgraphs
    from models.gemma4.model import single_device_mesh, use_projections
    from models.gemma4.speculative import prepare_target_weights, with_target_weights

    for key, value in {**CONFIGS["nvfp4"], "ATTNQUANT_CACHE": "0"}.items():
        monkeypatch.setenv(key, value)
    config, mesh = _model_config(gemma4_dir), single_device_mesh([CPU()])
    raw = {
        name.removeprefix("model.language_model."): tensor  # MAX's MTP adapter's names
        for name, tensor in load_state_dict(gemma4_dir).items()
        if name.startswith("model.language_model.")
    }
    checkpoint = SimpleNamespace(_filepaths=[gemma4_dir / "model.safetensors"])
    served, plan = prepare_target_weights(raw, config, checkpoint, CPU())
    with F.lazy(), default_dtype(config.dtype), default_device(mesh):
        target = UnifiedMTPGemma4ModuleV3Target(config, mesh)
        subgraphs = choose_layer_subgraphs(True, "cpu", CPU())
        use_projections(target, plan, activation=config.text_config.hidden_activation, layer_subgraphs=subgraphs, norm_kernel=False)
    declared = {name: tuple(t.shape) for name, t in target.parameters}
    layer_tensors = {k: tuple(v.shape) for k, v in served.items() if k.startswith("layers.")}
    assert {k: v for k, v in declared.items() if k.startswith("layers.")} == layer_tensors
    assert "layers.3.self_attn.qkv_proj.0.weight" in declared  # dense q | NVFP4 k
    assert served["layers.3.self_attn.qkv_proj.1.weight"].dtype == torch.uint8
    merged = with_target_weights({"target.old": 0, "draft.x": 1}, served)
    assert merged["draft.embed_tokens.weight"] is served["embed_tokens.weight"]
    assert "target.old" not in merged and merged["draft.x"] == 1


def test_mtp_model_parses_a_config_fresh_from_disk(gemma4_dir: Path, tmp_path: Path) -> None:
    """MAX's PipelineModel parses with the model's ``model_config_cls`` before
    anything of ours runs (in the model worker, on a config it has just read).
    MAX's own class fails here twice over: it refuses float32, and it reads
    ``num_experts``, which a ``gemma4_unified`` text config lacks (H200 run
    8). The MTP model's class must be ours."""
    from models.gemma4.speculative import AttnQuantUnifiedMTPGemma4Model

    fresh = tmp_path / "fresh"  # a path no earlier test parsed (and mutated)
    shutil.copytree(gemma4_dir, fresh)
    pipeline_config = _pipeline_config(fresh)
    assert not hasattr(pipeline_config.model.huggingface_config.text_config, "num_experts")
    config = AttnQuantUnifiedMTPGemma4Model.model_config_cls.initialize(pipeline_config, max_seq_len=512)
    assert config.text_config.num_experts == 0


def _pipeline_config(model_dir: Path):
    """MAX's PipelineConfig for a checkpoint directory (CPU, float32)."""
    from max.pipelines.lib import PipelineConfig
    from max.pipelines.lib.pipeline_args import PipelineArgs

    args = PipelineArgs(
        model_path=str(model_dir), quantization_encoding="float32", max_length=512,
        device_specs=[{"device_type": "cpu", "id": -1}],
    )  # fmt: skip
    return PipelineConfig.from_args(args)


def _model_config(model_dir: Path):
    """Our config for the tiny checkpoint, through MAX's PipelineConfig (CPU, float32)."""
    from models.gemma4.model_config import AttnQuantGemma4Config

    pipeline_config = _pipeline_config(model_dir)
    config = AttnQuantGemma4Config.initialize(pipeline_config, max_seq_len=512)
    state_dict = load_state_dict(model_dir)
    config.finalize(
        huggingface_config=pipeline_config.model.huggingface_config,
        state_dict=state_dict,
        return_logits=config.text_config.return_logits,
    )
    return config


# --- real serving on CPU --------------------------------------------------------


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attnquant-cache")


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, gemma4_dir: Path, cache_dir: Path, tmp_path_factory) -> Iterator[tuple[str, Server]]:
    name = request.param
    env = {**CONFIGS[name], "ATTNQUANT_CACHE_DIR": str(cache_dir)}
    log = tmp_path_factory.mktemp("logs") / f"serve-gemma4-{name}.log"
    server = start_server(gemma4_dir, env, log)
    try:
        yield name, server
    finally:
        server.stop()


def reference_model(model_dir: Path, env: dict[str, str]) -> torch.nn.Module:
    """transformers float32 with the weights MAX serves under ``env``."""
    from transformers.models.gemma4_unified.modeling_gemma4_unified import (
        Gemma4UnifiedForConditionalGeneration,
    )

    config = AttnQuantConfig.from_env({**env, "ATTNQUANT_CACHE": "0"})
    checkpoint = load_state_dict(model_dir)
    keys = find_projections(checkpoint)
    # The weighted scale search's importances, as a served Gemma 4 load computes them.
    importances = importance.for_quantization(checkpoint, keys, config, importance.GEMMA4)
    served = precompute_outside(checkpoint, config, keys=keys, importance=importances, progress=False).state_dict
    weights = {}
    for name, tensor in served.items():
        if not name.startswith("model.language_model."):
            continue  # the vision embedder: MAX ignores it, and so does this comparison
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale" in served and name.endswith(".weight"):
            packed = nvfp4.NVFP4Weight(
                tensor, served[f"{module}.weight_scale"], served[f"{module}.weight_scale_2"]
            )
            weights[name] = nvfp4.dequantize(packed)
        elif not name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            weights[name] = tensor.float()
    model = Gemma4UnifiedForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and not [m for m in missing if "language_model" in m], (missing, unexpected)
    return model.eval()


def test_completions_match_host_reference(served, gemma4_dir: Path) -> None:
    from transformers import AutoTokenizer

    name, server = served
    tokenizer = AutoTokenizer.from_pretrained(gemma4_dir)
    reference = reference_model(gemma4_dir, CONFIGS[name])
    plain = reference_model(gemma4_dir, CONFIGS["passthrough"]) if name != "passthrough" else None
    assert_greedy_matches_reference(
        server, reference, tokenizer, PROMPTS, new_tokens=NEW_TOKENS, atol=ATOL, plain=plain, label=name
    )



def test_load_lines_report_coverage_and_shared_kv(served) -> None:
    name, server = served
    log = server.log()
    load = next(line for line in log.splitlines() if "attnquant load:" in line)
    expected = {"passthrough": "NVFP4 0/26 projections", "nvfp4": "NVFP4 25/26 projections"}
    assert expected[name] in load, load
    assert "attnquant gemma4: 26 projections in 4 layers" in log
    assert "2 layers share k and v (attention_k_eq_v, no v_proj): [1, 3]" in log


def _mtp_model_on(device, gemma4_dir: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]):
    """Our MTP model, unbuilt, on ``device``, with MAX's config parse stood in
    for by its config class filled from ours (MAX's own parse refuses float32
    on CPU). Returns (model, our config)."""
    import dataclasses

    from max.pipelines.architectures.gemma4.model_config import Gemma4ForConditionalGenerationConfig
    from max.pipelines.architectures.unified_mtp_gemma4_modulev3.model import UnifiedMTPGemma4ModuleV3Model

    from models.gemma4.speculative import AttnQuantUnifiedMTPGemma4Model

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ours = _model_config(gemma4_dir)
    maxs = Gemma4ForConditionalGenerationConfig(**{
        f.name: getattr(ours, f.name) for f in dataclasses.fields(Gemma4ForConditionalGenerationConfig) if f.init
    })  # fmt: skip
    assert not hasattr(maxs, "attnquant")
    monkeypatch.setattr(UnifiedMTPGemma4ModuleV3Model, "_create_model_config", lambda self, state_dict: maxs)
    model = object.__new__(AttnQuantUnifiedMTPGemma4Model)
    model.devices = [device]
    model.weights = SimpleNamespace(_filepaths=[gemma4_dir / "model.safetensors"])
    model.pipeline_config = SimpleNamespace(runtime=SimpleNamespace(device_graph_capture=False))
    model._target_state_dict = {
        name.removeprefix("model.language_model."): tensor
        for name, tensor in load_state_dict(gemma4_dir).items()
        if name.startswith("model.language_model.")
    }
    return model, ours


def test_mtp_on_a_gpu_is_served_without_a_setting(
    custom_architectures, gemma4_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Checked on an sm_90 GPU (docs/quickstart.md, Speculative decoding): served,
    its weights prepared on the GPU, no warning; the old opt-in names its own removal."""
    from models.gemma4 import speculative

    gpu = SimpleNamespace(is_host=False, api="cuda")
    prepared: list[object] = []
    monkeypatch.setattr(speculative, "prepare_target_weights", lambda *a, **k: prepared.append(a) or ({}, {}))
    model, _ = _mtp_model_on(gpu, gemma4_dir, monkeypatch, {"ATTNQUANT_QUANT": "nvfp4"})
    with caplog.at_level("WARNING", logger=LOGGER_NAME):
        model._create_model_config({})
    assert len(prepared) == 1 and prepared[0][3] is gpu and not caplog.records
    monkeypatch.setenv("ATTNQUANT_MTP_ON_GPU", "allow")
    with pytest.raises(ValueError, match="ATTNQUANT_MTP_ON_GPU was removed: .* served on GPUs without it"):
        model._create_model_config({})


def test_mtp_model_config_carries_the_settings(
    custom_architectures, gemma4_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX's MTP model builds its config with MAX's own class
    (``Gemma4ForConditionalGenerationConfig.initialize``, not
    ``model_config_cls``), so nothing of ours has attached the ATTNQUANT_*
    settings when ``_create_model_config`` prepares the target: ours must
    (on the H200 it stopped with "no attribute 'attnquant'")."""
    from max.driver import CPU

    from models.gemma4.model import LANGUAGE_PREFIX

    model, ours = _mtp_model_on(CPU(), gemma4_dir, monkeypatch, {**CONFIGS["nvfp4"], "ATTNQUANT_CACHE": "0"})
    config = model._create_model_config({})
    assert config.attnquant.quant == ours.attnquant.quant == "nvfp4"
    assert model._served_target["layers.0.mlp.down_proj.weight"].dtype == torch.uint8
    assert {f"{LANGUAGE_PREFIX}layers.0.mlp.down_proj", f"{LANGUAGE_PREFIX}layers.0.self_attn.qkv_proj"} <= set(model._projection_plan)
