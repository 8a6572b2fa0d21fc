"""Mojo custom-op sources shipped with attnquant, and facts about them.

``OPS_PATH`` is the Mojo package (a directory with ``__init__.mojo``) that MAX
loads as a custom extension (``attnquant.graph.ops``). The ``.mojo`` files
must ship as package data. ``sm90_layout`` is the load-time weight layout the
sm90 NVFP4 kernel reads (pure torch).
"""

from pathlib import Path

OPS_PATH = Path(__file__).resolve().parent / "attnquant_ops"

MAX_GENERATED_RANK = 64
"""The generated ops' largest residual rank: the GPU kernel keeps ``x @ v`` in
a fixed shared-memory buffer of 64 values per row of x."""

GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh")
"""Activation names (Hugging Face config spelling) of the GELU the kernels apply
in their epilogues (``attnquant_ops/activation.mojo``): generated_mlp's and the
gated NVFP4 GEMV's."""

__all__ = ["GELU_TANH_NAMES", "MAX_GENERATED_RANK", "OPS_PATH"]
