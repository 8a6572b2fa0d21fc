"""attnquant's architectures plus a float32-capable Gemma 4 assistant, for CPU MTP checks.

``--custom-architectures bench/checks/mtp_cpu`` (with ``site/`` on PYTHONPATH: see
``bench/checks/mtp_cpu_check.py``). MAX's ``Gemma4AssistantForCausalLM`` accepts only
bfloat16, which MAX refuses on CPU; the fused MTP model loads the assistant's
tensors as they are on disk, so on CPU they must be float32 there too.
"""

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: attnquant, models

from attnquant import ARCHITECTURES as _ATTNQUANT  # noqa: E402
from max.pipelines.architectures.gemma4_assistant.arch import gemma4_assistant_arch  # noqa: E402

ARCHITECTURES = [
    *_ATTNQUANT,
    replace(gemma4_assistant_arch, default_encoding="float32", supported_encodings={"float32", "bfloat16"}),
]
