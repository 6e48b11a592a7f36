"""agentroll: a rollout engine for RL post-training of tool-using LLM agents.

The public API is what ``__all__`` lists (pinned by ``tests/test_public_api.py``); heavy
optional dependencies (torch kernels, vllm, docker, ray) are imported lazily by the modules
that need them.
"""

from agentroll.backends import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    MockBackend,
    MockResponse,
    SamplingParams,
)
from agentroll.chat import ChatTokenizer, HermesToolParser, ParsedOutput
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
from agentroll.run.metrics import MetricsWriter
from agentroll.run.recipe import Recipe, load_recipe
from agentroll.sandbox import Sandbox, SandboxConfig, open_sandbox
from agentroll.tool import Tool, tool
from agentroll.types import (
    ExecResult,
    Message,
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

__version__ = "0.1.0"

__all__ = [
    "AdmissionController",
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
    "GenerationChunk",
    "GenerationRequest",
    "GenerationTimeout",
    "HermesToolParser",
    "Message",
    "MetricsWriter",
    "MissingDependencyError",
    "MockBackend",
    "MockResponse",
    "ParsedOutput",
    "Recipe",
    "RolloutConfig",
    "RolloutEngine",
    "Rubric",
    "SamplingParams",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "StreamError",
    "Task",
    "Tool",
    "ToolCall",
    "ToolCallParseError",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "Trajectory",
    "TrajectoryBuffer",
    "Turn",
    "WeightSyncError",
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
