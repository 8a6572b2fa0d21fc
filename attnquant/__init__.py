"""attnquant: Gemma 3 / Gemma 4 on Modular MAX with NVFP4 linear projections.

``max serve --custom-architectures attnquant`` imports this package and reads
``ARCHITECTURES``. That attribute (and ``SERVED_CHECKPOINTS``, the checkpoint
architecture names they serve) is the one place the core reaches up to the
architectures in ``models/`` (docs/dev/architecture.md); it is resolved
lazily, so ``import attnquant.formats`` and the other layers never build MAX
modules. It is also where a bad ``ATTNQUANT_*`` setting stops plain
``max serve``: one line and exit status 1, before anything compiles.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("ARCHITECTURES", "SERVED_CHECKPOINTS"):
        from attnquant.config import AttnQuantConfig

        try:
            AttnQuantConfig.from_env()
        except ValueError as error:
            # MAX reads this attribute outside its import error handling; a
            # SystemExit passes through it as one line and a non-zero status.
            raise SystemExit(f"attnquant: error: {error}") from None
        import models

        return getattr(models, name)
    raise AttributeError(f"module 'attnquant' has no attribute {name!r}")
