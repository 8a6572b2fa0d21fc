"""attnquant's Gemma 3 (``Gemma3ForCausalLM``) for MAX."""

from .arch import gemma3_arch

ARCHITECTURES = [gemma3_arch]
