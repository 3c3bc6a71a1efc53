"""hpdl.serve: Flover temporal fusion of generation requests, with an OpenAI-compatible HTTP server.

Public API: ``LLMEngine`` (offline and step-wise), ``AsyncEngine`` (for servers), ``SamplingParams``,
``ModelSpec`` (weights from a HF directory or a named random config) and ``EngineConfig``.
"""

from hpdl.serve.engine import EngineConfig, LLMEngine, RequestOutput
from hpdl.serve.sampling import SamplingParams
from hpdl.serve.worker import NAMED_CONFIGS, ModelSpec

__all__ = ["EngineConfig", "LLMEngine", "ModelSpec", "NAMED_CONFIGS", "RequestOutput", "SamplingParams"]
