"""Load time: checkpoint -> theta -> W_eff -> NVFP4 -> fused layout, cached on disk.

Device-independent; run-time graph code (``attnquant.graph``) never runs here.
"""
