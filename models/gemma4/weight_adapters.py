"""Gemma 4 checkpoint names -> the names of our module tree.

MAX's ModuleV3 converters already produce them (``language_model.layers.N.
self_attn.q_proj.weight`` ...; the projections are fused later by
``attnquant.load.fuse``, which works on any prefix), so the registry's
adapter is MAX's (``Gemma4Model`` itself splits language and vision weights
with MAX's converters when it loads). What this module adds is the list of language tensors we know
how to serve: anything else in a decoder layer (MoE experts, per-layer
embeddings, ...) is a variant whose weights we would silently drop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from max.pipelines.architectures.gemma4_modulev3.weight_adapters import (
    convert_safetensor_state_dict,
)

from attnquant.formats.names import LAYER_NORMS, PROJECTION_PATH_PATTERN

__all__ = ["bare_nvfp4_names", "check_language_tensors", "convert_safetensor_state_dict", "unsupported_tensors"]

# Every tensor of a dense Gemma 4 decoder, below its prefix (``language_model.``
# in the ModuleV3 tree, none in the MTP target's).
_SERVED = re.compile(
    r"(?:.*\.)?(?:"
    r"embed_tokens\.weight|norm\.weight|lm_head\.weight|"
    r"layers\.\d+\.(?:"
    rf"(?:{PROJECTION_PATH_PATTERN})\.(?:weight|weight_scale|weight_scale_2|input_scale)|"
    r"self_attn\.(?:q_norm|k_norm)\.weight|"
    rf"(?:{'|'.join(LAYER_NORMS)})\.weight|"
    r"layer_scalar"
    r"))$"
)


_NVFP4_LEAF = re.compile(r"^(?P<module>.*_proj)\.weight\.(?P<leaf>data|weight_scale|weight_scale_2|input_scale)$")


def bare_nvfp4_names(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A ModelOpt NVFP4 checkpoint's projections under their checkpoint names.

    MAX's converter nests each NVFP4 projection's tensors under its
    ``weight`` (``<proj>.weight.data``, ``<proj>.weight.weight_scale``, ...)
    for its own quantized linear; attnquant reads them as stored
    (``<proj>.weight``, ``<proj>.weight_scale``, ...)."""
    bare = {}
    for name, value in state_dict.items():
        match = _NVFP4_LEAF.match(name)
        if match is None:
            bare[name] = value
        else:
            leaf = "weight" if match["leaf"] == "data" else match["leaf"]
            bare[f"{match['module']}.{leaf}"] = value
    return bare


def unsupported_tensors(names: Iterable[str]) -> list[str]:
    """Language-model tensor names a dense Gemma 4 decoder does not have."""
    return sorted(name for name in names if not _SERVED.fullmatch(name))


def check_language_tensors(names: Iterable[str]) -> None:
    """Raises ValueError naming the tensors of a variant we do not serve."""
    unknown = unsupported_tensors(names)
    if unknown:
        shown = ", ".join(unknown[:5])
        if len(unknown) > 5:
            shown += f" and {len(unknown) - 5} more"
        raise ValueError(
            f"attnquant does not serve this Gemma 4 checkpoint: its language model has "
            f"{len(unknown)} tensors a dense Gemma 4 decoder does not ({shown}), e.g. "
            "mixture-of-experts or per-layer-embedding weights. Serve it with MAX's own "
            "architecture (drop --custom-architectures attnquant)."
        )
