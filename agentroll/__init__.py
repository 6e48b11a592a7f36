"""agentroll: a rollout engine for RL post-training of tool-using LLM agents.

The public API is what ``__all__`` lists (pinned by ``tests/test_public_api.py``): what a
user constructs.  Backends, weights, the stream client and the trainer protocol load on
first use (``_LAZY``), so ``import agentroll`` imports neither torch, vllm, docker nor ray.
"""

from typing import TYPE_CHECKING, Any

from agentroll.backends import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    MockBackend,
    MockResponse,
    SamplingParams,
)
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, Rubric, load_environment
from agentroll.errors import (
    AgentrollError,
    BackendError,
    ChatTemplateError,
    CheckpointError,
    ConfigError,
    EnvError,
    EpisodeTimeout,
    GenerationTimeout,
    MissingDependencyError,
    SandboxError,
    StreamError,
    ToolCallParseError,
    ToolError,
    WeightSyncError,
)
from agentroll.rollout.admission import AdmissionController
from agentroll.rollout.buffer import BufferConfig, TrajectoryBuffer
from agentroll.rollout.checkpoint import EpisodeCheckpoint, load_checkpoints
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.rollout.pause import EpisodeView, fixed_policy, staleness_policy
from agentroll.run.recipe import Recipe, load_recipe
from agentroll.sandbox import Sandbox, SandboxConfig, open_sandbox
from agentroll.tool import Tool, tool
from agentroll.types import (
    ExecResult,
    Message,
    ResumePolicy,
    Strategy,
    Task,
    ToolCall,
    ToolResult,
    ToolSpec,
    Trajectory,
    Turn,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
)

if TYPE_CHECKING:
    from agentroll.backends.torch import TorchBackend
    from agentroll.backends.vllm import VLLMBackend
    from agentroll.backends.vllm_server import VLLMServerBackend
    from agentroll.fleet import FleetBackend, LocalReplica
    from agentroll.gateway import AgentEnvironment, Gateway, GatewayConfig
    from agentroll.stream import StreamClient
    from agentroll.trainer import GRPOTrainer, Trainer, TrainStats
    from agentroll.weights import WeightExporter, WeightUpdate

__version__ = "0.1.0"

#: public name -> the module that defines it, imported on first access
_LAZY = {
    "AgentEnvironment": "agentroll.gateway",
    "FleetBackend": "agentroll.fleet",
    "Gateway": "agentroll.gateway",
    "GatewayConfig": "agentroll.gateway",
    "GRPOTrainer": "agentroll.trainer",
    "LocalReplica": "agentroll.fleet",
    "StreamClient": "agentroll.stream",
    "TorchBackend": "agentroll.backends.torch",
    "TrainStats": "agentroll.trainer",
    "Trainer": "agentroll.trainer",
    "VLLMBackend": "agentroll.backends.vllm",
    "VLLMServerBackend": "agentroll.backends.vllm_server",
    "WeightExporter": "agentroll.weights",
    "WeightUpdate": "agentroll.weights",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentroll' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


__all__ = [
    "AdmissionController",
    "AgentEnvironment",
    "AgentrollError",
    "Backend",
    "BackendError",
    "BufferConfig",
    "ChatTemplateError",
    "ChatTokenizer",
    "CheckpointError",
    "ConfigError",
    "EnvError",
    "Environment",
    "EpisodeCheckpoint",
    "EpisodeState",
    "EpisodeTimeout",
    "EpisodeView",
    "ExecResult",
    "FleetBackend",
    "GRPOTrainer",
    "Gateway",
    "GatewayConfig",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationTimeout",
    "LocalReplica",
    "Message",
    "MissingDependencyError",
    "MockBackend",
    "MockResponse",
    "Recipe",
    "ResumePolicy",
    "RolloutConfig",
    "RolloutEngine",
    "Rubric",
    "SamplingParams",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "Strategy",
    "StreamClient",
    "StreamError",
    "Task",
    "Tool",
    "ToolCall",
    "ToolCallParseError",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "TorchBackend",
    "TrainStats",
    "Trainer",
    "Trajectory",
    "TrajectoryBuffer",
    "Turn",
    "VLLMBackend",
    "VLLMServerBackend",
    "WeightExporter",
    "WeightSyncError",
    "WeightUpdate",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
    "fixed_policy",
    "load_checkpoints",
    "load_environment",
    "load_recipe",
    "open_sandbox",
    "staleness_policy",
    "tool",
]
