"""Applies ../patches.py in every Python process that imports MAX's MTP model.

On PYTHONPATH for bench/checks/mtp_cpu_check.py's servers only: MAX's model worker
is a separate process, so patching the parent is not enough. The patches run
right after MAX's ModuleV3 MTP model module is first imported; with
MTP_ORACLE_DRAFTS set, bench/harness/oracle_drafter.py's drafter is
installed after them.
"""

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

TRIGGER = "max.pipelines.architectures.unified_mtp_gemma4_modulev3.model"
HERE = Path(__file__).resolve().parents[1]
ORACLE = HERE.parents[1] / "harness" / "oracle_drafter.py"


def _load(name, file):
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _load("attnquant_mtp_cpu_patches", HERE / "patches.py").apply()
            oracle = _load("attnquant_oracle_drafter", ORACLE)
            if oracle.ENV_DRAFTS in os.environ:
                oracle.install(module.UnifiedMTPGemma4ModuleV3Model)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
