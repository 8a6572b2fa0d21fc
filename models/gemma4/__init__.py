"""attnquant's Gemma 4 (``Gemma4ForConditionalGeneration``,
``Gemma4UnifiedForConditionalGeneration`` and their drafter pairings) for MAX."""

from .arch import GEMMA4_ARCHITECTURES, gemma4_arch, gemma4_unified_arch

ARCHITECTURES = GEMMA4_ARCHITECTURES
SERVED_CHECKPOINTS = (gemma4_arch.name, gemma4_unified_arch.name)
"""The ``architectures`` names of the checkpoints these serve (a drafter
pairing keeps its target's name in the checkpoint)."""
