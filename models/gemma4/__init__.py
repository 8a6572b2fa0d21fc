"""attnquant's Gemma 4 (``Gemma4ForConditionalGeneration``,
``Gemma4UnifiedForConditionalGeneration`` and their drafter pairings) for MAX."""

from .arch import GEMMA4_ARCHITECTURES

ARCHITECTURES = GEMMA4_ARCHITECTURES
