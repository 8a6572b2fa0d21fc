"""attnquant: Gemma 3 / Gemma 4 on Modular MAX with NVFP4 linear projections.

``max serve --custom-architectures attnquant`` imports this package and reads
``ARCHITECTURES``; it is resolved lazily so that the load-time library
(``attnquant.nvfp4``, ``theta``, ...) imports without building MAX modules.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "ARCHITECTURES":
        from models.gemma3 import ARCHITECTURES as gemma3
        from models.gemma4 import ARCHITECTURES as gemma4

        return [*gemma3, *gemma4]
    raise AttributeError(f"module 'attnquant' has no attribute {name!r}")
