"""Hugging Face Gemma 3 names -> the names of our module trees.

Same renames as MAX's ModuleV3 Gemma 3 and Gemma 3 multimodal; the
projection tensors are renamed too and fused later by ``attnquant.load.fuse``
(it works on any prefix).

Text + vision checkpoints come in two layouts, and both are accepted:

* Google's (``google/gemma-3-4b-it``) and transformers 5's ``save_pretrained``:
  ``language_model.model.*``, ``multi_modal_projector.*`` and
  ``vision_tower.vision_model.*`` (Google's) or ``vision_tower.*`` (what
  transformers 5.12 writes: no ``vision_model.``, which MAX's own converter
  misses, so MAX's vision tower would find none of its weights);
* transformers 5's in-memory names: ``model.language_model.*``,
  ``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.*``.
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


# Text + vision checkpoints: the language model, as MAX's Gemma3LanguageModel
# names it (``language_model.<Gemma3TextModel's names>``) ...
_LANGUAGE_RENAMES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "language_model."),
    ("model.language_model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
)
# ... and the vision tower + projector, as MAX's Gemma3VisionModel names them.
_VISION_RENAMES: tuple[tuple[str, str], ...] = (
    ("vision_tower.vision_model.", ""),
    ("model.vision_tower.vision_model.", ""),
    ("vision_tower.", ""),
    ("model.vision_tower.", ""),
    ("multi_modal_projector.", "projector."),
    ("model.multi_modal_projector.", "projector."),
)


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str | None:
    for before, after in renames:
        if name.startswith(before):
            return after + name[len(before) :]
    return None


def multimodal_language_name(name: str) -> str | None:
    """The language model's name for a text + vision checkpoint tensor, or
    None when it is not a language-model tensor."""
    return _renamed(name, _LANGUAGE_RENAMES)


def multimodal_vision_name(name: str) -> str | None:
    """The vision model's name (MAX's ``Gemma3VisionModel``) for a text +
    vision checkpoint tensor, or None when it is not a vision tensor."""
    return _renamed(name, _VISION_RENAMES)


def convert_multimodal_language_state_dict(state_dict: dict[str, Weights]) -> dict[str, WeightData]:
    return {
        new: value.data() for name, value in state_dict.items() if (new := multimodal_language_name(name)) is not None
    }


def convert_multimodal_vision_state_dict(state_dict: dict[str, Weights]) -> dict[str, WeightData]:
    return {
        new: value.data() for name, value in state_dict.items() if (new := multimodal_vision_name(name)) is not None
    }
