"""Hugging Face Gemma 3 names -> the names of our module tree.

Same renames as MAX's ModuleV3 Gemma 3; the projection tensors are renamed
too and fused later by ``attnquant.load.fuse`` (it works on any prefix).
"""

from __future__ import annotations

from max.graph.weights import WeightData, Weights

# Multimodal checkpoints (Gemma 3 4B+) nest the text model one level deeper.
_RENAMES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "language_model."),
    ("model.language_model.", "language_model."),
    ("model.", "language_model."),
    ("lm_head.", "language_model.lm_head."),
)


def to_max_name(name: str) -> str:
    for before, after in _RENAMES:
        if name.startswith(before):
            return after + name[len(before) :]
    return name


def convert_safetensor_state_dict(
    state_dict: dict[str, Weights], **unused_kwargs: object
) -> dict[str, WeightData]:
    return {
        to_max_name(name): value.data()
        for name, value in state_dict.items()
        if not name.startswith(("vision_tower.", "multi_modal_projector."))
    }
