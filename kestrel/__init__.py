"""Kestrel: serving and RL-training engine for hybrid linear/sparse-attention MoE models."""

from kestrel.engine.llm import LLM
from kestrel.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
