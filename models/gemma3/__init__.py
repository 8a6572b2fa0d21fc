"""attnquant's Gemma 3 for MAX: ``Gemma3ForCausalLM`` (text) and
``Gemma3ForConditionalGeneration`` (text + vision, the vision tower MAX's)."""

from ..registration import with_module_v3_twin
from .arch import gemma3_arch, gemma3_multimodal_arch

ARCHITECTURES = [*with_module_v3_twin(gemma3_arch), *with_module_v3_twin(gemma3_multimodal_arch)]
SERVED_CHECKPOINTS = (gemma3_arch.name, gemma3_multimodal_arch.name)
"""The ``architectures`` names of the checkpoints these serve."""
