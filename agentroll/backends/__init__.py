"""Generation backends: ``mock`` (scripted), ``torch`` (built-in engine), ``vllm``, ``http``."""

from agentroll.backends.base import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    ResumePolicy,
    SamplingParams,
)
from agentroll.backends.mock import MockBackend, MockResponse

__all__ = [
    "Backend",
    "GenerationChunk",
    "GenerationRequest",
    "MockBackend",
    "MockResponse",
    "ResumePolicy",
    "SamplingParams",
]
