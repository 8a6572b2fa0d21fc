"""attnquant's Gemma 3 (``Gemma3ForCausalLM``) for MAX."""

from ..registration import with_module_v3_twin
from .arch import gemma3_arch

ARCHITECTURES = with_module_v3_twin(gemma3_arch)
SERVED_CHECKPOINTS = (gemma3_arch.name,)
"""The ``architectures`` names of the checkpoints these serve."""
