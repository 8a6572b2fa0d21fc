"""Applies ../patches.py in every Python process that imports MAX's MTP model.

On PYTHONPATH for bench/checks/mtp_cpu_check.py's servers only: MAX's model worker
is a separate process, so patching the parent is not enough. The patches run
right after MAX's ModuleV3 MTP model module is first imported.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

TRIGGER = "max.pipelines.architectures.unified_mtp_gemma4_modulev3.model"
PATCHES = Path(__file__).resolve().parents[1] / "patches.py"


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patches_spec = importlib.util.spec_from_file_location("attnquant_mtp_cpu_patches", PATCHES)
            patches = importlib.util.module_from_spec(patches_spec)
            patches_spec.loader.exec_module(patches)
            patches.apply()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
