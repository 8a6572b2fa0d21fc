"""Mojo custom-op sources shipped with attnquant.

``OPS_PATH`` is the Mojo package (a directory with ``__init__.mojo``) that MAX
loads as a custom extension; ``attnquant.kernels.custom_extensions_path()``
returns it. The ``.mojo`` files must ship as package data.
"""

from pathlib import Path

OPS_PATH = Path(__file__).resolve().parent / "attnquant_ops"

__all__ = ["OPS_PATH"]
