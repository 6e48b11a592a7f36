"""TRL's GRPOTrainer trained on agentroll episodes: calculator tasks with a sandboxed tool.

``AgentrollRollout`` is the trainer's ``rollout_func``: each step's prompts run as
multi-turn agentroll episodes on the built-in engine, after the trainer's weights reached
the engine as a checksummed delta.  Prints one line per step: loss, reward, digest match.
The tiny project-made model is untrained, so it rarely earns a reward: the lines show the
mechanics; a warmed-up checkpoint (``make demo``) shows learning.
Run: ``python examples/trl_grpo.py`` (CPU, under a minute).
"""

from __future__ import annotations

import tempfile

from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from agentroll import RolloutConfig, SamplingParams, load_environment
from agentroll.integrations.trl import AgentrollRollout, agentroll_reward, trl_dataset
from agentroll.model.tiny import create_tiny

STEPS = 3


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_tiny(f"{tmp}/model"))
        env = load_environment("calculator", num_tasks=8, seed=0)
        tasks = list(env.tasks())
        config = RolloutConfig(progress="off", sampling=SamplingParams(max_tokens=48))
        args = GRPOConfig(
            output_dir=f"{tmp}/out",
            use_cpu=True,
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=STEPS,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
        )
        with AgentrollRollout(env, model_dir, tasks=tasks, config=config) as rollout:
            trainer = GRPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(model_dir),
                reward_funcs=[agentroll_reward],
                args=args,
                train_dataset=trl_dataset(tasks),
                processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
                rollout_func=rollout,
            )
            trainer.train()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            for log, sync in zip(logs, rollout.syncs, strict=True):
                print(
                    f"step={sync.step} loss={log['loss']:.4f} reward={log['reward']:.3f} "
                    f"sync={sync.kind} version={sync.version} "
                    f"digest_match={sync.trainer_digest == sync.backend_digest}"
                )


if __name__ == "__main__":
    main()
