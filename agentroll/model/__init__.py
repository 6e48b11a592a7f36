"""Model artefacts made by the project itself: the seeded tiny checkpoint used by tests,
benchmarks and the demo (loadable by the built-in engine, transformers and vLLM)."""

from agentroll.model.tiny import HEAD_DIM, create_tiny, random_weights, write_checkpoint

__all__ = ["HEAD_DIM", "create_tiny", "random_weights", "write_checkpoint"]
