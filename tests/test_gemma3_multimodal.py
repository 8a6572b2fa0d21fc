"""Our Gemma 3 text + vision (``Gemma3ForConditionalGeneration``) on MAX, CPU.

Registration, weight names, the capture ABI, batching and memory planning
without a compile; then real serving of ``tests/gemma3_multimodal_fixtures.py``'s
tiny random checkpoint through ``run_max.py serve``: one server per
configuration (passthrough, NVFP4 everywhere), shared by its tests (each
compile costs minutes on 2 cores). The host reference is transformers'
``Gemma3ForConditionalGeneration`` in float32, text only, with the weights
MAX serves (dequantized where they are NVFP4). MAX's vision tower is
GPU-only: on CPU it is not compiled and an image request is refused.
"""

from __future__ import annotations

import base64
import inspect
import io
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import requests
import torch

from .gemma3_multimodal_fixtures import (
    TINY_TEXT,
    expected_projection_count,
    write_tiny_gemma3_multimodal,
)
from .serving import REPO, Server, assert_greedy_matches_reference, start_server

pytestmark = pytest.mark.max

NAME = "Gemma3ForConditionalGeneration"
PROMPTS = ("The capital of France is", "Once upon a time")
NEW_TOKENS = 10
ATOL = 2e-3  # MAX vs transformers, both float32, same weights
CONFIGS = {
    "passthrough": {"ATTNQUANT_QUANT": "none"},
    "nvfp4": {"ATTNQUANT_QUANT": "nvfp4"},
}


@pytest.fixture(scope="session")
def mm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("tiny_gemma3_mm"))


@pytest.fixture(scope="session")
def custom_architectures() -> None:
    """MAX's global lookup with attnquant imported, as ``--custom-architectures`` does."""
    from max.pipelines.lib.arch_lookup import ARCH_LOOKUP

    ARCH_LOOKUP.import_custom_architectures([str(REPO / "attnquant")])


# --- registration (no compile) --------------------------------------------------


@pytest.mark.parametrize("prefer_module_v3", [False, True])
def test_name_resolves_to_ours(custom_architectures, prefer_module_v3: bool) -> None:
    from max.pipelines.lib.arch_lookup import find_architecture

    import attnquant
    from models.gemma3.arch import gemma3_multimodal_arch
    from models.gemma3.model import AttnQuantGemma3MultiModalModel

    arch = find_architecture(NAME, prefer_module_v3=prefer_module_v3)
    assert arch is not None and arch.pipeline_model is AttnQuantGemma3MultiModalModel
    assert NAME in attnquant.SERVED_CHECKPOINTS
    assert gemma3_multimodal_arch.supports_device_graph_capture
    assert "float32" in gemma3_multimodal_arch.supported_encodings


def test_every_architecture_takes_a_modelopt_export_on_gpu() -> None:
    """MAX gives an NVFP4 checkpoint the float4_e2m1fnx2 encoding on a GPU and
    refuses an architecture that does not list it, before any of ours runs."""
    import models

    for arch in models.ARCHITECTURES:
        assert {"bfloat16", "float32", "float4_e2m1fnx2"} <= set(arch.supported_encodings), arch.name


def test_modelopt_encoding_serves_the_rest_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """float4_e2m1fnx2's dtype (uint8) is only the packed weights': the model
    and its text tower run in bf16."""
    from max.dtype import DType
    from max.pipelines.architectures.gemma3multimodal_modulev3.model_config import (
        Gemma3ForConditionalGenerationConfig,
    )

    from models.gemma3.model_config import AttnQuantGemma3MultiModalConfig

    parsed = SimpleNamespace(dtype=DType.uint8, text_config=SimpleNamespace(dtype=DType.uint8))
    monkeypatch.setattr(
        Gemma3ForConditionalGenerationConfig, "initialize_from_config", classmethod(lambda cls, *a, **k: parsed)
    )
    config = AttnQuantGemma3MultiModalConfig.initialize_from_config(None, None, max_seq_len=16)
    assert (config.dtype, config.text_config.dtype) == (DType.bfloat16, DType.bfloat16)


# --- weight names (no compile) -----------------------------------------------------


def _max_converted(converter, names: list[str]) -> set[str]:
    return set(converter({n: SimpleNamespace(data=lambda: None) for n in names}))


def test_both_checkpoint_layouts_get_max_names(mm_dir: Path) -> None:
    """Google's layout gets exactly MAX's names; transformers 5's
    ``save_pretrained`` layout (``vision_tower.*``, which MAX's converter
    misses) and its in-memory names get the same ones."""
    from max.pipelines.architectures.gemma3multimodal_modulev3.weight_adapters import (
        convert_safetensor_language_state_dict,
        convert_safetensor_vision_state_dict,
    )

    from attnquant.load.checkpoint import tensor_shapes
    from models.gemma3.weight_adapters import (
        convert_multimodal_language_state_dict as ours_language,
        convert_multimodal_vision_state_dict as ours_vision,
    )

    saved = list(tensor_shapes(mm_dir))  # transformers 5.12's save_pretrained
    google = [re.sub(r"^vision_tower\.", "vision_tower.vision_model.", n) for n in saved]
    top = re.compile(r"^(language_model\.model|vision_tower|multi_modal_projector)\.")
    in_memory = [top.sub(lambda m: f"model.{m[1].removesuffix('.model')}.", n) for n in saved]
    assert any(n.startswith("model.language_model.layers.") for n in in_memory)
    language, vision = _max_converted(ours_language, google), _max_converted(ours_vision, google)
    assert language == _max_converted(convert_safetensor_language_state_dict, google)
    assert vision == _max_converted(convert_safetensor_vision_state_dict, google)
    # Why ours exists: MAX's finds no vision-tower tensor in the saved layout.
    assert not any(n.startswith("encoder.") for n in _max_converted(convert_safetensor_vision_state_dict, saved))
    for layout in (saved, in_memory):
        assert _max_converted(ours_language, layout) == language
        assert _max_converted(ours_vision, layout) == vision
    assert _max_converted(ours_language, ["lm_head.weight"]) == {"language_model.lm_head.weight"}
    assert len(language) + len(vision) == len(saved)


def test_vision_tensors_are_the_ones_maxs_tower_declares(mm_dir: Path) -> None:
    """What the vision tower would bind on a GPU, checked on CPU without a compile."""
    from max.experimental import functional as F
    from max.pipelines.architectures.gemma3multimodal_modulev3.vision_model.gemma3multimodal import (
        Gemma3VisionModel,
    )

    from attnquant.load.checkpoint import tensor_shapes
    from models.gemma3.weight_adapters import multimodal_vision_name

    config = _model_config(mm_dir)
    with F.lazy():
        tower = Gemma3VisionModel(config)
    declared = {name: tuple(int(d) for d in t.shape) for name, t in tower.parameters}
    served = {
        new: shape for name, (shape, _) in tensor_shapes(mm_dir).items() if (new := multimodal_vision_name(name))
    }
    assert declared == served


# --- capture ABI, batching, memory planning (no compile) ---------------------------


def test_capture_buffers_follow_the_compiled_call_order() -> None:
    """``buffers`` lists what MAX's ``execute`` passes the compiled language
    graph, in its order (capture replays ``model(*inputs.buffers)``), and
    refuses inputs that carry pixels."""
    from max.pipelines.architectures.gemma3multimodal_modulev3.model import Gemma3MultiModalModelV3

    from models.gemma3.inputs import AttnQuantGemma3MultiModalInputs

    call = re.search(
        r"self\.language_model\((.*?)\n\s*\)", inspect.getsource(Gemma3MultiModalModelV3.execute), re.S
    )
    assert call, "MAX's Gemma3MultiModalModelV3.execute no longer calls self.language_model(...)"
    args = [a.strip().removeprefix("model_inputs.") for a in call.group(1).split(",") if a.strip()]
    assert args == [
        "tokens", "return_n_logits", "input_row_offsets",
        "image_embeddings", "image_token_indices", "*tree.leaves(kv_cache_inputs)",
    ]  # fmt: skip
    kv = {"a": "kv0", "b": ["kv1", "kv2"]}
    inputs = AttnQuantGemma3MultiModalInputs(
        tokens="tokens", input_row_offsets="offsets", return_n_logits="n", kv_cache_inputs=kv,
        image_token_indices="indices", image_embeddings="embeddings",
    )  # fmt: skip
    assert inputs.buffers == ("tokens", "n", "offsets", "embeddings", "indices", "kv0", "kv1", "kv2")
    inputs.pixel_values = "pixels"
    with pytest.raises(RuntimeError, match="carry images have no capture ABI.*decode steps only"):
        inputs.buffers


def test_batching_gives_model_dtype_empties_for_warmup_contexts(mm_dir: Path) -> None:
    """MAX's capture warm-up hands the batch processor ``TextContext``s (no
    ``next_images``); ours batches them, with the cached zero-row image
    embeddings in the model dtype (float32 on CPU) and the graph's
    image-embedding input typed the same."""
    from max.driver import CPU
    from max.dtype import DType
    from max.graph import DeviceRef
    from max.nn.transformer import ReturnLogits
    from max.pipelines.context import TextContext, TokenBuffer
    from max.pipelines.lib.interfaces.batch_processor import BatchProcessorRuntime

    from models.gemma3.inputs import AttnQuantGemma3MultiModalBatchProcessor

    config = _model_config(mm_dir)
    runtime = BatchProcessorRuntime(
        pipeline_config=_pipeline_config(mm_dir), devices=[CPU()], return_logits=ReturnLogits.LAST_TOKEN,
        max_batch_size=4, max_seq_len=512, max_batch_input_tokens=512,
    )  # fmt: skip
    processor = AttnQuantGemma3MultiModalBatchProcessor(config, runtime)

    def step() -> object:
        contexts = [TextContext(max_length=512, tokens=TokenBuffer(np.zeros(1, dtype=np.int64))) for _ in range(2)]
        return processor.prepare_initial_token_inputs([contexts], kv_cache_inputs={"kv": "leaf"}, return_n_logits=1)

    first, second = step(), step()
    assert first.pixel_values is None
    assert first.image_embeddings.dtype == DType.float32
    assert tuple(first.image_embeddings.shape) == (0, TINY_TEXT["hidden_size"])
    assert tuple(first.image_token_indices.shape) == (0,)
    # Cached: a decode step allocates neither.
    assert second.image_embeddings is first.image_embeddings
    assert second.image_token_indices is first.image_token_indices
    assert first.buffers[3:] == (first.image_embeddings, first.image_token_indices, "leaf")
    symbolic = processor.get_language_symbolic_inputs(
        kv_params=config.kv_params, device_ref=DeviceRef.CPU(), hidden_size=TINY_TEXT["hidden_size"]
    )
    assert symbolic[3].dtype == DType.float32


def test_memory_planner_reserves_for_vision_on_gpu_only(mm_dir: Path) -> None:
    from max.pipelines.architectures.gemma3multimodal_modulev3.arch import gemma3_multimodal_modulev3_arch as maxs

    from models.gemma3.arch import gemma3_multimodal_arch

    config = _model_config(mm_dir)
    ours, theirs = gemma3_multimodal_arch.memory_planner(config), maxs.memory_planner(config)

    def on(device_type: str) -> SimpleNamespace:
        return SimpleNamespace(model=SimpleNamespace(device_specs=[SimpleNamespace(device_type=device_type, id=0)]))

    gpu, cpu = on("gpu"), on("cpu")
    assert ours.estimate_activation_memory(gpu, None) == theirs.estimate_activation_memory(gpu, None) == 15 * 2**30
    assert ours.estimate_signal_buffer_memory(gpu) == theirs.estimate_signal_buffer_memory(gpu) > 0
    assert ours.estimate_activation_memory(cpu, None) == 0
    assert ours.estimate_signal_buffer_memory(cpu) == 0


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
    from models.gemma3.model_config import AttnQuantGemma3MultiModalConfig

    return AttnQuantGemma3MultiModalConfig.initialize(_pipeline_config(model_dir), max_seq_len=512)


# --- real serving on CPU ------------------------------------------------------------


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attnquant-cache")


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, mm_dir: Path, cache_dir: Path, tmp_path_factory) -> Iterator[tuple[str, Server]]:
    name = request.param
    env = {**CONFIGS[name], "ATTNQUANT_CACHE_DIR": str(cache_dir)}
    log = tmp_path_factory.mktemp("logs") / f"serve-gemma3-mm-{name}.log"
    server = start_server(mm_dir, env, log)
    try:
        yield name, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(served, mm_dir: Path) -> torch.nn.Module:
    """transformers float32 (``Gemma3ForConditionalGeneration``, text only)
    with the weights MAX serves in this configuration."""
    from attnquant.tools.verify import transformers_model

    name, _ = served
    model = transformers_model(mm_dir, {**CONFIGS[name], "ATTNQUANT_CACHE": "0"})
    assert type(model).__name__ == NAME
    return model


@pytest.fixture(scope="session")
def tokenizer(mm_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(mm_dir)


def test_completions_match_host_reference(served, reference, tokenizer, mm_dir: Path) -> None:
    from attnquant.tools.verify import transformers_model

    name, server = served
    plain = None
    if name != "passthrough":
        plain = transformers_model(mm_dir, {**CONFIGS["passthrough"], "ATTNQUANT_CACHE": "0"})
    assert_greedy_matches_reference(
        server, reference, tokenizer, PROMPTS, new_tokens=NEW_TOKENS, atol=ATOL, plain=plain, label=name
    )


def test_chat_endpoint_answers_as_the_reference(served, reference, tokenizer, mm_dir: Path) -> None:
    """Text-only chat: the processor's chat template, then the same greedy path."""
    from transformers import AutoProcessor

    name, server = served
    reply = server.chat("The capital of France is", NEW_TOKENS)["choices"][0]["message"]["content"]
    messages = [{"role": "user", "content": "The capital of France is"}]
    processor = AutoProcessor.from_pretrained(mm_dir)
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert reply == tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True), name


def test_load_lines_report_coverage_and_the_vision_tower(served) -> None:
    name, server = served
    log = server.log()
    load = next(line for line in log.splitlines() if "attnquant load:" in line)
    n = expected_projection_count()
    expected = {"passthrough": f"NVFP4 0/{n} projections", "nvfp4": f"NVFP4 {n}/{n} projections"}
    assert expected[name] in load, load
    assert re.search(r"attnquant gemma3: vision tower and projector \(23 tensors, [\d.]+ MiB\) are MAX's, unquantized; "
                     r"not compiled: MAX's runs on GPU only", log), log[-3000:]  # fmt: skip
    memory = re.search(r"attnquant memory: weights ([\d.]+) GiB served, not the checkpoint's ([\d.]+) GiB", log)
    assert (memory is not None) == (name == "nvfp4"), name


def _png() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 30, 3), 200, np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_an_image_request_on_cpu_is_refused_and_the_server_goes_on(served) -> None:
    name, server = served
    if name != "nvfp4":
        pytest.skip("one configuration is enough")
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": _png()}},
    ]
    response = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
        timeout=120,
    )
    assert response.status_code == 400, response.text
    assert "runs on GPU only: image inputs are not served here" in response.text
    # An id outside the vocabulary: the same 400 as the text line's tokenizer.
    bad = requests.post(
        server.url + "/v1/completions",
        json={"model": server.model, "prompt": [2, 999, 5], "max_tokens": 4},
        timeout=120,
    )
    assert bad.status_code == 400 and f"outside this model's vocabulary [0, {TINY_TEXT['vocab_size']})" in bad.text
    text = server.completion(PROMPTS[0], max_tokens=4)["choices"][0]["text"]
    assert text.strip() and "Worker crashed" not in server.log()
