"""Fails loudly when MAX changes under one of attnquant's assumptions.

Each test names the workaround in ``attnquant/max_compat.py`` or the MAX
internal our Gemma 3 builds on; when one fails, revisit that code.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import inspect
import re

from importlib.metadata import version
from pathlib import Path

from max.graph.weights import SafetensorWeights
from max.pipelines.architectures.gemma3_modulev3.gemma3 import Gemma3
from max.pipelines.architectures.gemma3_modulev3.inputs import Gemma3Inputs
from max.pipelines.architectures.gemma3_modulev3.layers.attention import Gemma3Attention
from max.pipelines.architectures.gemma3_modulev3.model_config import Gemma3Config
from max.pipelines.lib.interfaces.pipeline_model import ModuleV3PipelineModelWithKVCache

from attnquant.max_compat import MAX_VERSION
from models.gemma3.layers.attention import _ADOPTED
from models.gemma3.model_config import AttnQuantGemma3Config

REPO = Path(__file__).resolve().parents[1]


def test_max_version_is_the_one_we_target() -> None:
    assert version("max") == MAX_VERSION


def test_gemma3_config_still_lacks_devices() -> None:
    # DevicesFromMesh exists only because of this; delete it when MAX adds one.
    assert "devices" not in {f.name for f in dataclasses.fields(Gemma3Config)}
    assert not hasattr(Gemma3Config, "devices")
    assert hasattr(AttnQuantGemma3Config, "devices")


def test_safetensor_weights_keep_their_files_privately() -> None:
    source = inspect.getsource(SafetensorWeights.__init__)
    assert "self._filepaths" in source


def test_builtin_inputs_have_no_buffer_abi_and_forward_order_is_ours() -> None:
    fields = {f.name for f in dataclasses.fields(Gemma3Inputs)}
    assert {"tokens", "input_row_offsets", "return_n_logits"} <= fields
    assert "buffers" not in Gemma3Inputs.__dict__
    params = list(inspect.signature(Gemma3.forward).parameters)
    # AttnQuantGemma3Inputs.buffers returns exactly this order.
    assert params[:4] == ["self", "tokens", "return_n_logits", "input_row_offsets"]


def test_attention_config_attributes_we_adopt_exist() -> None:
    source = inspect.getsource(Gemma3Attention.__init__)
    for name in _ADOPTED:
        assert f"self.{name} =" in source, name


def test_modulev3_load_model_still_calls_prepare_state_dict() -> None:
    source = inspect.getsource(ModuleV3PipelineModelWithKVCache.load_model)
    assert "self._prepare_state_dict(state_dict, model_config)" in source


def test_max_leaks_python_variables_to_children_unless_env_is_given() -> None:
    # In a fresh interpreter that has loaded MAX: a child without env= runs
    # outside the venv; one given child_environment() runs inside it.
    probe = (
        "import subprocess, sys\n"
        "import max.pipelines.architectures.gemma3_modulev3.gemma3\n"
        "from attnquant.max_compat import child_environment\n"
        "code = ['-c', 'import sys; print(sys.prefix)']\n"
        "bare = subprocess.run([sys.executable, *code], capture_output=True, text=True).stdout\n"
        "ours = subprocess.run([sys.executable, *code], capture_output=True, text=True,\n"
        "                      env=child_environment()).stdout\n"
        "print(bare.strip() != sys.prefix, ours.strip() == sys.prefix)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONEXECUTABLE"}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert result.stdout.split() == ["True", "True"], result.stderr[-2000:]


def test_gemma3_multimodal_capture_assumptions() -> None:
    """What our Gemma 3 text + vision's capture support rests on
    (docs/dev/max-workarounds.md, "Gemma 3 text + vision")."""
    from max.pipelines.architectures.gemma3multimodal_modulev3.arch import gemma3_multimodal_modulev3_arch
    from max.pipelines.architectures.gemma3multimodal_modulev3.batch_processor import (
        Gemma3MultiModalModuleV3BatchProcessor,
    )
    from max.pipelines.architectures.gemma3multimodal_modulev3.inputs import Gemma3MultiModalModelInputs
    from max.pipelines.context import TextContext
    from max.pipelines.lib.pipeline_variants.overlap_text_generation import OverlapTextGenerationPipeline

    # MAX's own cannot be captured: no buffer ABI, capture off.
    assert "buffers" not in Gemma3MultiModalModelInputs.__dict__
    assert not gemma3_multimodal_modulev3_arch.supports_device_graph_capture
    # Only token-generation (decode) batches replay a captured graph; the rest run execute().
    source = inspect.getsource(OverlapTextGenerationPipeline)
    assert re.search(r"use_graph_capture_replay = \(\s*runner is not None\s*and bool\(inputs\)\s*"
                     r"and inputs\.batch_type == BatchType\.TG", source)  # fmt: skip
    # A prompt's images are batched from its unprocessed images only; warm-up's contexts have none.
    assert "context.next_images" in inspect.getsource(Gemma3MultiModalModuleV3BatchProcessor._prepare_vision_inputs)
    assert not hasattr(TextContext, "next_images")
    assert "TextContext(" in inspect.getsource(OverlapTextGenerationPipeline._warmup_model_inputs)


def test_gemma3_attention_still_ignores_query_pre_attn_scalar() -> None:
    """MAX's Gemma 3 builds its attention without a scale (so head_dim ** -0.5);
    ours passes transformers' query_pre_attn_scalar ** -0.5
    (``max_compat.gemma3_attention_scale``): Gemma 3 27B has 168 and head_dim 128."""
    from max.pipelines.architectures.gemma3_modulev3.gemma3 import Gemma3TextModel

    from attnquant.max_compat import gemma3_attention_scale

    assert not re.search(r"\bscale=", inspect.getsource(Gemma3TextModel.__init__))
    assert "math.sqrt(1.0 / kv_params.head_dim)" in inspect.getsource(Gemma3Attention.__init__)
    assert gemma3_attention_scale(168, 128) == 168**-0.5
    assert gemma3_attention_scale(None, 128) == 128**-0.5
