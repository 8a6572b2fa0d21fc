"""Four in-process patches that let MAX 26.7's MTP speculative path run on CPU.

For ``bench/checks/mtp_cpu_check.py`` only: attnquant never applies them. MAX
serves every speculative method through its overlap pipeline, which is
GPU-only; these remove what stops it on a CPU, one source edit each:

* ``OverlapTextGenerationPipeline.__init__`` refuses CPU models;
* ``RealizeFutureTokenProcessor._compute_mappings`` refuses host buffers;
* the assistant's cross-attention hard-codes a bfloat16 output, which the
  CPU kernel rejects for float32 queries (its output must match q);
* the fused graph declares its (empty) vision embeddings bfloat16, while the
  ModuleV3 MTP model feeds float32 ones on CPU.

Each edit checks that MAX's source still reads as expected and fails
loudly otherwise, so a MAX upgrade cannot turn one into a silent no-op.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from typing import Any

_MARK = "_attnquant_cpu_mtp_patched"


def _edit_method(cls: type, name: str, old: str, new: str) -> None:
    """Recompiles ``cls.name`` from MAX's source with ``old`` replaced by ``new``."""
    source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
    if old not in source:
        raise RuntimeError(f"{cls.__qualname__}.{name}: MAX's source changed; this patch does not apply")
    module = sys.modules[cls.__module__]
    namespace: dict[str, Any] = {}
    code = "from __future__ import annotations\n" + source.replace(old, new)
    exec(compile(code, module.__file__, "exec"), module.__dict__, namespace)  # noqa: S102
    setattr(cls, name, namespace[name])


def _bfloat16_empty_vision_embeddings(self: Any, devices: Any) -> Any:
    from max.dtype import DType
    from max.pipelines.architectures.gemma4.batch_vision_inputs import create_empty_embeddings

    if not hasattr(self, "_cached_empty_embeddings"):
        hidden = self.huggingface_config.text_config.hidden_size
        self._cached_empty_embeddings = create_empty_embeddings(devices, hidden, DType.bfloat16)
    return self._cached_empty_embeddings


def apply() -> None:
    from max.pipelines.architectures.unified_mtp_gemma4_modulev3 import gemma4_assistant_modulev3 as assistant
    from max.pipelines.architectures.unified_mtp_gemma4_modulev3.model import UnifiedMTPGemma4ModuleV3Model
    from max.pipelines.lib.pipeline_variants import overlap_text_generation as overlap

    if getattr(overlap.OverlapTextGenerationPipeline, _MARK, False):
        return
    refusal = 'raise ValueError(\n            "OverlapTextGenerationPipeline does not support CPU models."\n        )'
    _edit_method(overlap.OverlapTextGenerationPipeline, "__init__", refusal, "pass")
    guard = 'raise ValueError(\n            "Realize future tokens processor must be on the gpu."\n        )'
    _edit_method(overlap.RealizeFutureTokenProcessor, "_compute_mappings", guard, "pass")
    _edit_method(
        assistant.Gemma4AssistantAttention, "forward", "output_dtype=DType.bfloat16,", "output_dtype=xq.dtype,"
    )
    UnifiedMTPGemma4ModuleV3Model.empty_vision_embeddings = _bfloat16_empty_vision_embeddings
    setattr(overlap.OverlapTextGenerationPipeline, _MARK, True)
    print("mtp_cpu: MAX's four CPU refusals patched in this process", flush=True)
