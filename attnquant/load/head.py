"""The output head: which tensor it is, and what attnquant serves for it.

Our architectures compute the output head (``h @ W^T``, W [vocab, hidden])
themselves, through attnquant's matmul, instead of MAX's own: MAX's tied head
is a bf16 matmul with one row per sequence, which MAX 26.7 gets wrong on
sm_90 for 2 to 63 sequences (docs/dev/max-workarounds.md). W is the
checkpoint's ``lm_head.weight`` when the model has its own, else the
embedding it is tied to. ``ATTNQUANT_LM_HEAD=nvfp4`` serves a packed NVFP4
copy of W (the embedding stays, for the token lookup).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutputHead:
    """Where a model's output head lives in its state dict.

    Attributes:
        group: the head's plan key and tensor prefix (``language_model.lm_head``).
        embedding: the embedding's tensor name (``language_model.embed_tokens.weight``).
        tied: whether the model ties the head to the embedding (its config says so).
    """

    group: str
    embedding: str
    tied: bool

    @property
    def weight_name(self) -> str:
        return f"{self.group}.weight"

    def source(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The head's weight: the checkpoint's own, or the tied embedding.

        Raises:
            ValueError: an untied model whose checkpoint has no head weight.
        """
        if self.tied:
            return tensors[self.embedding]
        if self.weight_name not in tensors:
            raise ValueError(
                f"the model's config unties its output head from the embedding, but the checkpoint "
                f"has no {self.weight_name} (or lm_head.weight); set tie_word_embeddings in config.json"
            )
        return tensors[self.weight_name]
