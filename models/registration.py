"""Registering our architectures so they win MAX's lookup."""

from __future__ import annotations

from dataclasses import replace

from max.pipelines.lib import SupportedArchitecture


def with_module_v3_twin(arch: SupportedArchitecture) -> list[SupportedArchitecture]:
    """``arch`` and a copy named ``<name>_ModuleV3``.

    MAX resolves the base name first, and ``--prefer-module-v3`` looks up
    ``<name>_ModuleV3``; registering both means ours serves either way.
    """
    return [arch, replace(arch, name=f"{arch.name}_ModuleV3")]
