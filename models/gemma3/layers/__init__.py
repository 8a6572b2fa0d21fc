"""Gemma 3 modules whose projections come from an attnquant ``ProjectionPlan``."""
