"""MAX's tokenizers with the checks that keep one request from taking a server down.

* A prompt given as token ids is passed by MAX straight to the model's
  embedding gather: an id outside ``[0, vocab)`` crashes the model worker and
  every later request is refused. Ours refuses it with HTTP 400 naming the
  id (MAX turns an ``InputError`` from ``new_context`` into a 400).
* A checkpoint without tokenizer files gets a placeholder tokenizer of a
  handful of tokens from transformers, and every completion decodes to "".
  Ours refuses to start instead, in one line.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

from max.pipelines.architectures.gemma4.tokenizer import Gemma4Tokenizer
from max.pipelines.context.exceptions import InputError
from max.pipelines.lib import TextAndVisionTokenizer, TextTokenizer

from .vision import IMAGES_NEED_A_GPU, serves_on_cpu


def embedding_rows(pipeline_config: Any) -> int:
    """The model's vocabulary: rows of its embedding (``text_config`` for multimodal configs)."""
    hf = pipeline_config.model.huggingface_config
    return int((getattr(hf, "text_config", None) or hf).vocab_size)


def check_prompt_ids(prompt: Any, vocab_size: int) -> None:
    """Raises ``InputError`` (HTTP 400) for a token-id prompt with an id outside ``[0, vocab_size)``."""
    if prompt is None or isinstance(prompt, str):
        return
    for position, token in enumerate(prompt):
        if not isinstance(token, Integral) or not 0 <= token < vocab_size:
            raise InputError(
                f"prompt token id {token!r} (position {position}) is outside this model's vocabulary [0, {vocab_size})"
            )


def check_tokenizer_size(tokens: int, vocab_size: int, model_path: str) -> None:
    """Refuses, in one line, a tokenizer far smaller than the model's vocabulary:
    what transformers returns when the tokenizer files are missing."""
    if tokens < vocab_size // 2:
        raise SystemExit(
            f"attnquant: the tokenizer of {model_path} has {tokens} tokens for a {vocab_size}-token model: "
            "its tokenizer files (tokenizer.json / tokenizer.model, tokenizer_config.json) are missing; "
            "copy them from the base model's checkpoint"
        )


class CheckedTokensMixin:
    """Mixin for a MAX tokenizer class (``delegate``: the transformers tokenizer)."""

    delegate: Any
    model_path: str

    def __init__(self, model_path: str, pipeline_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model_path, pipeline_config, *args, **kwargs)  # type: ignore[call-arg]
        self.model_vocab_size = embedding_rows(pipeline_config)
        check_tokenizer_size(len(self.delegate), self.model_vocab_size, model_path)

    async def new_context(self, request: Any) -> Any:
        check_prompt_ids(request.prompt, self.model_vocab_size)
        return await super().new_context(request)  # type: ignore[misc]


class AttnQuantTextTokenizer(CheckedTokensMixin, TextTokenizer):
    """Gemma 3 text models' tokenizer."""


class AttnQuantGemma4Tokenizer(CheckedTokensMixin, Gemma4Tokenizer):
    """Gemma 4's tokenizer (text and images)."""


class AttnQuantTextAndVisionTokenizer(CheckedTokensMixin, TextAndVisionTokenizer):
    """Gemma 3 4B/12B/27B's tokenizer (text and images): MAX's, with the token
    checks, and on a CPU server an image request refused with HTTP 400
    (MAX's Gemma 3 vision tower runs on GPU only; models/common/vision.py)."""

    def __init__(self, model_path: str, pipeline_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model_path, pipeline_config, *args, **kwargs)
        self.images_refused = serves_on_cpu(pipeline_config)

    async def new_context(self, request: Any) -> Any:
        if self.images_refused and request.images:
            raise InputError(IMAGES_NEED_A_GPU)
        return await super().new_context(request)
