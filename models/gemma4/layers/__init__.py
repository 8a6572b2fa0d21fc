"""Gemma 4 modules whose projections come from an attnquant ``ProjectionPlan``."""
