"""MAX architectures served by attnquant (one package per model family).

Each package mirrors MAX's own architecture packages: ``arch.py`` registers,
``model.py`` builds, ``model_config.py`` parses, ``weight_adapters.py``
renames, ``layers/`` holds modules. They sit above the core (``attnquant``).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "ARCHITECTURES":
        from .gemma3 import ARCHITECTURES as gemma3
        from .gemma4 import ARCHITECTURES as gemma4

        return [*gemma3, *gemma4]
    if name == "SERVED_CHECKPOINTS":
        from .gemma3 import SERVED_CHECKPOINTS as gemma3
        from .gemma4 import SERVED_CHECKPOINTS as gemma4

        return (*gemma3, *gemma4)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
