"""Generation: the batched step engine, sampling, and the LLM API on top."""

from tiermoe.engine.engine import Engine, EngineConfig
from tiermoe.engine.llm import LLM, RequestOutput
from tiermoe.engine.sampling import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
