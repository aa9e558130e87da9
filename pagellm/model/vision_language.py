"""Vision-language checkpoints served as their language model alone.

An HF `mistral3` folder (`Mistral3ForConditionalGeneration`: Ministral 3, Mistral Small 3.1)
nests the text model's config in `text_config` and prefixes its tensors with
`language_model.` (or `model.language_model.`). pagellm reads that config and those tensors
and skips the vision tower and its projector; requests with images are refused by the chat
route, which accepts text content parts only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagellm.logger import init_logger

logger = init_logger(__name__)

VISION_LANGUAGE_TYPES = ("mistral3",)
# checkpoint prefix of the language model -> the HF causal LM's
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def is_vision_language(config: dict[str, Any]) -> bool:
    return config.get("model_type") in VISION_LANGUAGE_TYPES


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config; the outer config's `tie_word_embeddings` is the one the
    checkpoint was saved under."""
    logger.info("%s is a vision-language model: serving its language model only; requests "
                "with images are not supported.", config["model_type"])
    text = dict(config["text_config"])
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def text_weights(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under the causal LM's names; vision tensors skipped."""
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        yield name, tensor
