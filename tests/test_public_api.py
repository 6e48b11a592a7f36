import subprocess
import sys

import agentroll

EXPECTED = [
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


def test_public_names_are_pinned() -> None:
    assert agentroll.__all__ == EXPECTED == sorted(EXPECTED)
    for name in EXPECTED:
        assert getattr(agentroll, name) is not None


def test_import_does_not_load_heavy_dependencies() -> None:
    code = "import sys, agentroll; print(','.join(m for m in ('torch', 'vllm', 'docker', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
