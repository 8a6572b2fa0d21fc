"""Layers our Gemma 3 and Gemma 4 share: the gated MLP and the attention tail."""
