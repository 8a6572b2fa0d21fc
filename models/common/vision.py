"""Image inputs on a server whose vision tower cannot run.

MAX's Gemma 3 vision tower (``gemma3multimodal_modulev3``) runs on GPU
only: its attention is MAX's GPU flash attention and its pixel input is
bfloat16, which MAX refuses on CPU. A CPU server of a text-and-vision
checkpoint serves text, and refuses an image request in one line (HTTP 400,
in the tokenizer, before the model worker sees it) instead of crashing the
worker in the compiled graph.
"""

from __future__ import annotations

from typing import Any

IMAGES_NEED_A_GPU = (
    "this server runs on CPU, and the model's vision tower (MAX's) runs on GPU only: "
    "image inputs are not served here. Send text only, or serve the model on a GPU"
)


def serves_on_cpu(pipeline_config: Any) -> bool:
    """Whether MAX's pipeline config places the model on host devices only."""
    specs = list(pipeline_config.model.device_specs)
    return bool(specs) and all(spec.device_type == "cpu" for spec in specs)
