"""Batched token sampling."""

from pagellm.sample.metadata import SamplingMetadata, SamplingRow, build_sampling_metadata
from pagellm.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "build_sampling_metadata",
]
