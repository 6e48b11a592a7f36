"""GRPOTrainer on the tiny model: behaviour-logprob parity with the built-in engine, the
direction and bounds of the policy-gradient step (clip, importance cap, kv-lag modes),
exports a replica applies bit-exactly, bit-identical resume, and a supervised warm-up."""

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from agentroll.backends.base import SamplingParams
from agentroll.chat import ChatTokenizer
from agentroll.engine.engine import EngineConfig, LLMEngine
from agentroll.engine.models.decoder import load_model, read_tensors
from agentroll.errors import ConfigError
from agentroll.trainer import (
    Batch,
    GRPOConfig,
    GRPOTrainer,
    Trainer,
    TrainStats,
    collate,
    kv_lag_terms,
    ppo_objective,
)
from agentroll.trainer.packing import common_prefix
from agentroll.types import Trajectory, decode_msgpack, encode_msgpack
from agentroll.weights.apply import WeightStore


def rollout(
    model_dir: Path, n: int, *, temperature: float, max_tokens: int = 24
) -> list[Trajectory]:
    """``n`` sequences sampled by the built-in engine, as trajectories (two per group)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    prompts = {f"r{i}": [5 + i, 17, 33 + 2 * i, 100 + i, 7] for i in range(n)}
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    for i, (rid, prompt) in enumerate(prompts.items()):
        engine.add_request(rid, prompt, params, seed=1000 + i)
    sampled: dict[str, list[tuple[int, float, int, int]]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None and out.token_id is not None
            sampled[out.request_id].append(
                (out.token_id, out.logprob, out.policy_version, out.kv_version)
            )
    trajs = []
    for i, (rid, prompt) in enumerate(prompts.items()):
        gen = sampled[rid]
        pad = [-1] * len(prompt)
        trajs.append(
            Trajectory(
                id=rid,
                task_id=f"t{i // 2}",
                group_id=f"g{i // 2}",
                reward=float(i % 2),
                token_ids=prompt + [g[0] for g in gen],
                logprobs=[math.nan] * len(prompt) + [g[1] for g in gen],
                loss_mask=[0] * len(prompt) + [1] * len(gen),
                policy_version=pad + [g[2] for g in gen],
                kv_version=pad + [g[3] for g in gen],
            )
        )
    return trajs


@pytest.fixture(scope="module")
def trajs(tiny_model: Path) -> list[Trajectory]:
    return rollout(tiny_model, 4, temperature=1.0)


@pytest.fixture
def batch(trajs: list[Trajectory]) -> Batch:
    return collate(trajs)


def weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.params.items()}


def record_grads(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    """A dict that the trainer's next optimizer step fills with the gradients it applies."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def record():  # type: ignore[no-untyped-def]
        grads.update({n: p.grad.clone() for n, p in trainer.params.items()})
        return step()

    trainer.optimizer.step = record  # type: ignore[method-assign]
    return grads


def seq_logprob(trainer: GRPOTrainer, batch: Batch, row: int) -> float:
    return float(trainer.logprobs(batch)[row][batch.loss_mask[row]].sum())


# -- parity with the engine ------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_engine_and_first_ratio_is_one(
    tiny_model: Path, temperature: float
) -> None:
    trajs = rollout(tiny_model, 4, temperature=temperature)
    batch = collate(trajs)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(temperature=temperature, micro_batch_tokens=60))
    lp = trainer.logprobs(batch)
    m = batch.loss_mask
    assert int(m.sum()) == 4 * 24 and batch.input_ids.shape == (4, 29)  # two per pass
    assert float((lp[m] - batch.behaviour_logprobs[m]).abs().max()) <= 1e-4
    stats = trainer.step(batch)
    assert abs(stats.ratio_mean - 1.0) <= 1e-4 and abs(stats.ratio_max - 1.0) <= 1e-4
    assert stats.clip_fraction == 0.0 and abs(stats.kl) <= 1e-6
    assert stats.version == trainer.version == 1 and stats.tokens == 96
    assert stats.trajectories == 4 and stats.grad_norm > 0


def test_trainer_logprobs_without_temperature_differ(tiny_model: Path) -> None:
    """The temperature is part of the parity: at T=0.7 the plain softmax does not match."""
    batch = collate(rollout(tiny_model, 2, temperature=0.7))
    trainer = GRPOTrainer(tiny_model, GRPOConfig(temperature=1.0))
    m = batch.loss_mask
    assert float((trainer.logprobs(batch)[m] - batch.behaviour_logprobs[m]).abs().max()) > 1e-2


# -- the direction of the step and its bounds ------------------------------------------------


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_the_sequence_logprob(
    tiny_model: Path, trajs: list[Trajectory], sign: float
) -> None:
    batch = collate(trajs, advantages=np.array([sign, 0.0, 0.0, 0.0]))
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-4))
    before = seq_logprob(trainer, batch, 0)
    trainer.step(batch)
    after = seq_logprob(trainer, batch, 0)
    assert (after - before) * sign > 0.05


def test_group_advantages_raise_the_better_sample(
    tiny_model: Path, trajs: list[Trajectory]
) -> None:
    batch = collate(trajs)  # rewards 0, 1 in each group of two
    assert batch.advantages.tolist() == pytest.approx([-0.7071, 0.7071] * 2, abs=1e-3)
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-4))
    before = [seq_logprob(trainer, batch, r) for r in range(4)]
    trainer.step(batch)
    after = [seq_logprob(trainer, batch, r) for r in range(4)]
    gain = [a - b for a, b in zip(after, before, strict=True)]
    assert gain[1] > gain[0] and gain[3] > gain[2]


@pytest.mark.parametrize(("shift", "sign"), [(-1.0, 1.0), (1.0, -1.0)])
def test_clip_engages_far_from_the_behaviour_policy(
    tiny_model: Path, batch: Batch, shift: float, sign: float
) -> None:
    """r = e (A > 0) or 1/e (A < 0) is outside [0.8, 1.2] on the side PPO clips: no
    gradient at all, the weights do not move."""
    trainer = GRPOTrainer(tiny_model)
    exact = trainer.logprobs(batch)
    m = batch.loss_mask
    batch.behaviour_logprobs = torch.where(m, exact + shift, 0.0)
    batch.advantages = torch.full((4,), sign)
    before = weights(trainer)
    stats = trainer.step(batch)
    assert stats.clip_fraction == 1.0 and stats.grad_norm == 0.0
    assert stats.ratio_mean == pytest.approx(math.exp(-shift), rel=1e-4)
    assert stats.kl == pytest.approx(math.exp(-shift) - 1 + shift, rel=1e-3)
    assert all(torch.equal(before[n], p) for n, p in trainer.params.items())


def test_ppo_objective_gradient_is_the_truncated_importance_weight() -> None:
    """d J / d logp = min(r, C) * A where the clip is inactive, 0 where it is active."""
    log_r = torch.tensor([0.0, math.log(2.0), 2.0, math.log(1.1), math.log(2.0), -1.0, 100.0])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -2.0])
    logp = torch.zeros(7, requires_grad=True)
    j, _, clipped = ppo_objective(logp, -log_r, adv, 5.0, clip_low=0.2, clip_high=0.2)
    j.sum().backward()
    assert logp.grad is not None
    want = [1.0, -2.0, -5.0, 1.1, 0.0, math.exp(-1.0), -10.0]
    assert logp.grad.tolist() == pytest.approx(want, rel=1e-5)
    assert clipped.tolist() == [False, False, False, False, True, False, False]
    assert bool(torch.isfinite(j).all())  # an absurd ratio (e^100) stays finite
    assert (logp.grad.abs() <= 5.0 * adv.abs() + 1e-6).all()  # the cap bounds every token


def test_kv_lag_terms() -> None:
    pv = torch.tensor([3, 3, 3, 3, -1])
    kv = torch.tensor([3, 2, 0, -1, -1])  # normal, lag 1, lag 3, unknown, not sampled
    w, c, lagged = kv_lag_terms(pv, kv, GRPOConfig(kv_lag="weight", kv_lag_weight=0.5))
    assert lagged.tolist() == [False, True, True, False, False]
    assert w.tolist() == [1.0, 0.5, 0.125, 1.0, 1.0] and c.tolist() == [5.0] * 5
    w, c, _ = kv_lag_terms(pv, kv, GRPOConfig(kv_lag="mask"))
    assert w.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0] and c.tolist() == [5.0] * 5
    w, c, _ = kv_lag_terms(pv, kv, GRPOConfig(kv_lag="cap", kv_lag_cap=1.5))
    assert w.tolist() == [1.0] * 5 and c.tolist() == [5.0, 1.5, 1.5, 5.0, 5.0]


def lagged_batch(trajs: list[Trajectory]) -> tuple[Batch, torch.Tensor]:
    """Policy version 3 everywhere; the second half of sequence 0's tokens were sampled over
    KV from version 1 (lag 2).  Returns the batch and the lagged-token mask."""
    batch = collate(trajs, advantages=np.array([-1.0, 1.0, -0.5, 0.5]))
    m = batch.loss_mask
    batch.policy_version = torch.where(m, 3, -1).int()
    lagged = torch.zeros_like(m)
    lagged[0, 5 + 12 :] = m[0, 5 + 12 :]
    batch.kv_version = torch.where(lagged, 1, batch.policy_version).int()
    return batch, lagged


def test_kv_lag_modes_change_the_loss_as_documented(
    tiny_model: Path, trajs: list[Trajectory]
) -> None:
    batch, lagged = lagged_batch(trajs)
    n_lag, n_all = int(lagged.sum()), int(batch.loss_mask.sum())
    assert n_lag == 12

    def loss(b: Batch, **cfg: object) -> TrainStats:
        return GRPOTrainer(tiny_model, GRPOConfig(**cfg)).evaluate(b)  # type: ignore[arg-type]

    plain = loss(batch, kv_lag="weight", kv_lag_weight=1.0)  # lag changes nothing
    assert plain.kv_lagged_tokens == n_lag
    # mask: exactly the loss of the batch without those tokens
    masked = loss(batch, kv_lag="mask")
    without = collate(trajs, advantages=batch.advantages.numpy())
    without.loss_mask = batch.loss_mask & ~lagged
    assert masked.loss == pytest.approx(loss(without).loss, rel=1e-6, abs=1e-9)
    assert masked.extra["loss_tokens"] == n_all - n_lag
    # weight: lagged terms scaled by 0.5 ** 2, the denominator still counts them
    normal_sum = masked.loss * (n_all - n_lag)
    lagged_sum = plain.loss * n_all - normal_sum
    weighted = loss(batch, kv_lag="weight", kv_lag_weight=0.5)
    assert weighted.loss == pytest.approx((normal_sum + 0.25 * lagged_sum) / n_all, rel=1e-5)
    assert abs(lagged_sum) > 1e-3  # the lagged tokens do contribute
    # cap: lagged tokens with r = e^0.5 and A = -1 get weight kv_lag_cap=1 instead of r
    trainer = GRPOTrainer(tiny_model)
    exact = trainer.logprobs(batch)
    batch.behaviour_logprobs = torch.where(lagged, exact - 0.5, batch.behaviour_logprobs)
    capped = loss(batch, kv_lag="cap", kv_lag_cap=1.0)
    uncapped = loss(batch, kv_lag="weight", kv_lag_weight=1.0)
    r = math.exp(0.5)
    assert capped.loss - uncapped.loss == pytest.approx(
        n_lag * (-1.0) * (r - 1.0) / n_all, rel=1e-4
    )
    assert capped.extra["is_capped_fraction"] == pytest.approx(n_lag / n_all)


def test_mask_mode_with_every_token_lagged_leaves_the_weights(
    tiny_model: Path, trajs: list[Trajectory]
) -> None:
    batch = collate(trajs)
    batch.policy_version = torch.where(batch.loss_mask, 2, -1).int()
    batch.kv_version = torch.where(batch.loss_mask, 0, -1).int()
    trainer = GRPOTrainer(tiny_model, GRPOConfig(kv_lag="mask"))
    before = weights(trainer)
    stats = trainer.step(batch)
    assert stats.kv_lagged_tokens == stats.tokens == 96 and stats.extra["loss_tokens"] == 0
    assert stats.version == 1 and stats.loss == 0.0
    assert all(torch.equal(before[n], p) for n, p in trainer.params.items())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_micro_batching_does_not_change_the_step(
    tiny_model: Path, trajs: list[Trajectory], agg: str
) -> None:
    batch = collate(trajs[:3], advantages=np.array([1.0, -0.3, 0.5]))
    batch.loss_mask[1, 20:] = False  # unequal token counts per sequence
    results = []
    for budget in (1, 10_000):
        trainer = GRPOTrainer(
            tiny_model,
            GRPOConfig(micro_batch_tokens=budget, loss_agg=agg, lr=1e-3),  # type: ignore[arg-type]
        )
        exact = trainer.logprobs(batch)
        batch.behaviour_logprobs = torch.where(batch.loss_mask, exact - 0.1, 0.0)
        grads = record_grads(trainer)
        results.append((trainer.step(batch), grads))
    (a, ga), (b, gb) = results
    assert abs(a.loss) > 0.1
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    assert all(torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-7) for n in ga)


def test_step_refuses_missing_behaviour_logprobs(tiny_model: Path, batch: Batch) -> None:
    trainer = GRPOTrainer(tiny_model)
    batch.behaviour_logprobs[0, 6] = math.nan
    with pytest.raises(ValueError, match="sft_step"):
        trainer.step(batch)
    assert trainer.version == 0


def test_sft_step_lowers_the_cross_entropy(tiny_model: Path, batch: Batch) -> None:
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=3e-3, max_grad_norm=None))
    batch.behaviour_logprobs[:] = math.nan  # demonstrations need no logprobs
    m = batch.loss_mask

    def ce() -> float:
        return -float(trainer.logprobs(batch, temperature=1.0)[m].mean())

    start = ce()
    losses = [trainer.sft_step(batch).loss for _ in range(4)]
    assert losses[0] == pytest.approx(start, rel=1e-5)
    assert ce() < start - 0.5 and losses[-1] < losses[0]
    assert trainer.version == 4


# -- exports, training state, checkpoints ----------------------------------------------------


def test_exports_apply_bit_exactly_on_a_replica(tiny_model: Path, batch: Batch) -> None:
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-3))
    replica = WeightStore(read_tensors(tiny_model), version=0)
    fresh = WeightStore(read_tensors(tiny_model), version=0)
    assert trainer.export().kind == "full"  # nothing trained yet: the base itself
    for version in (1, 2):
        trainer.step(batch)
        delta = trainer.export()
        assert (delta.kind, delta.base_version, delta.version) == ("delta", version - 1, version)
        assert trainer.export() is delta  # idempotent without a step
        assert replica.apply(delta) == trainer.digest() == replica.verify()
    full = trainer.export(base_version=0)  # a replica left behind
    assert full.kind == "full" and full.version == 2
    assert fresh.apply(full) == trainer.digest() == fresh.verify()
    for name, p in trainer.params.items():
        assert torch.equal(replica.tensors[name], p.detach())


def test_bf16_export_reaches_the_engine(tiny_model: Path, batch: Batch) -> None:
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-3, export_dtype="bfloat16"))
    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="bfloat16"))
    trainer.step(batch)
    trainer.step(batch)
    update = trainer.export()
    assert update.base_version == 0 and update.version == 2
    engine.apply_update(update)
    assert engine.weight_store().verify() == trainer.digest() == update.digest


def test_save_load_resumes_bit_identically(
    tiny_model: Path, trajs: list[Trajectory], tmp_path: Path
) -> None:
    cfg = GRPOConfig(lr=1e-3, weight_decay=0.01)
    first, second = collate(trajs[:2]), collate(trajs[2:])
    a = GRPOTrainer(tiny_model, cfg)
    a.step(first)
    a.save(tmp_path / "state")
    expected = a.step(second)
    b = GRPOTrainer(tiny_model, cfg)
    b.load(tmp_path / "state")
    assert b.version == 1
    got = b.step(second)
    assert got.loss == expected.loss and got.grad_norm == expected.grad_norm
    assert b.version == a.version == 2 and b.digest() == a.digest()
    assert torch.equal(b.generator.get_state(), a.generator.get_state())
    # after a load the exporter restarts from the loaded weights
    assert b.export(base_version=0).kind == "full"
    assert b.export(base_version=1).kind == "delta"


def test_load_refuses_another_model(tiny_model: Path, tmp_path: Path) -> None:
    from agentroll.model.tiny import create_tiny

    other = GRPOTrainer(create_tiny(tmp_path / "one-layer", layers=1))
    other.save(tmp_path / "state")
    with pytest.raises(ConfigError, match="does not match"):
        GRPOTrainer(tiny_model).load(tmp_path / "state")
    with pytest.raises(ConfigError, match="not a trainer state"):
        GRPOTrainer(tiny_model).load(tmp_path / "missing")


def test_save_pretrained_is_a_checkpoint_the_engine_serves(
    tiny_model: Path, batch: Batch, tmp_path: Path
) -> None:
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-3))
    trainer.step(batch)
    out = trainer.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(out).named_weights()
    assert all(torch.equal(loaded[n], p.detach()) for n, p in trainer.params.items())
    ChatTokenizer.from_pretrained(out)  # tokenizer files came along
    engine = LLMEngine(EngineConfig(model=str(out)))
    ids = batch.input_ids[0, : int(batch.lengths[0])].tolist()
    ours = trainer.logprobs(batch, temperature=1.0)[0, 1 : len(ids)]
    assert float((torch.tensor(engine.score(ids)) - ours).abs().max()) <= 1e-4


# -- API -------------------------------------------------------------------------------------


def test_public_names() -> None:
    import agentroll.trainer

    assert agentroll.trainer.__all__ == [
        "Batch",
        "GRPOConfig",
        "GRPOTrainer",
        "TrainStats",
        "Trainer",
        "TrajectoryDataset",
        "collate",
        "group_advantages",
        "kv_lag_terms",
        "ppo_objective",
    ]


def rollout_like(ids: list[int]) -> list[Trajectory]:
    n = len(ids)
    return [
        Trajectory(
            id="x",
            task_id="t",
            group_id="g",
            token_ids=ids,
            logprobs=[math.nan] + [-1.0] * (n - 1),
            loss_mask=[0] + [1] * (n - 1),
            policy_version=[-1] + [0] * (n - 1),
            kv_version=[-1] + [0] * (n - 1),
        )
    ]


def test_malformed_batches_are_refused(tiny_model: Path, batch: Batch) -> None:
    trainer = GRPOTrainer(tiny_model)
    bad = collate(rollout_like([1, 5000]))
    with pytest.raises(ValueError, match="vocabulary"):
        trainer.logprobs(bad)
    batch.lengths[0] = 10  # loss tokens past the row's end would read another sequence
    with pytest.raises(ValueError, match="past a row's length"):
        trainer.step(batch)
    assert trainer.version == 0


def test_protocol_config_and_stats(tiny_model: Path, batch: Batch) -> None:
    trainer = GRPOTrainer(tiny_model)
    assert isinstance(trainer, Trainer)
    stats = trainer.step(batch)
    assert decode_msgpack(encode_msgpack(stats), TrainStats) == stats
    assert stats.reward_mean == 0.5 and stats.reward_std == 0.5
    with pytest.raises(ConfigError, match="kv_lag_cap"):
        GRPOConfig(kv_lag_cap=6.0)
    with pytest.raises(ConfigError, match="kv_lag must be"):
        GRPOConfig(kv_lag="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="export_dtype"):
        GRPOConfig(export_dtype="fp7")
    with pytest.raises(ConfigError, match="temperature"):
        GRPOConfig(temperature=0.0)
    assert msgspec.json.decode(msgspec.json.encode(GRPOConfig()), type=GRPOConfig) == GRPOConfig()


def shared_prefix_trajs(n: int, prefix: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    head = rng.integers(3, 500, prefix).tolist()
    out = []
    for i in range(n):
        tail = rng.integers(3, 500, int(rng.integers(4, 20))).tolist()
        k = len(tail)
        out.append(
            Trajectory(
                id=f"s{i}",
                task_id="t",
                group_id=f"g{i // 2}",
                reward=float(i % 3),
                token_ids=head + tail,
                logprobs=[math.nan] * prefix + [-1.0] * k,
                loss_mask=[0] * prefix + [1] * k,
                policy_version=[-1] * prefix + [0] * k,
                kv_version=[-1] * prefix + [0] * k,
            )
        )
    return out


def test_shared_prefix_is_computed_once_with_the_same_result(tiny_model: Path) -> None:
    """Rows that share a long prefix (an agent's system prompt) give the same logprobs, loss
    and gradients whether the prefix is computed once per micro-batch or once per row."""
    batch = collate(shared_prefix_trajs(6, prefix=48))
    assert common_prefix(batch, range(6)) >= 48
    results = []
    for budget in (1, 10_000):  # one row per micro-batch (no sharing) vs all rows together
        trainer = GRPOTrainer(tiny_model, GRPOConfig(micro_batch_tokens=budget, lr=1e-3))
        exact = trainer.logprobs(batch)
        batch.behaviour_logprobs = torch.where(batch.loss_mask, exact - 0.1, 0.0)
        grads = record_grads(trainer)
        results.append((exact, trainer.step(batch), grads))
    (la, sa, ga), (lb, sb, gb) = results
    assert torch.allclose(la, lb, atol=1e-5)
    assert sa.loss == pytest.approx(sb.loss, rel=1e-5)
    assert sa.grad_norm == pytest.approx(sb.grad_norm, rel=1e-4)
    assert all(torch.allclose(ga[n], gb[n], rtol=1e-4, atol=1e-7) for n in ga)


def test_entropy_bonus_widens_the_policy(tiny_model: Path, trajs: list[Trajectory]) -> None:
    """With zero advantages the only gradient is the entropy bonus: entropy goes up."""
    batch = collate(trajs, advantages=np.zeros(len(trajs)))
    trainer = GRPOTrainer(tiny_model, GRPOConfig(lr=1e-2, entropy_coef=0.1))
    before = trainer.evaluate(batch).extra["entropy"]
    for _ in range(3):
        trainer.step(batch)
    assert trainer.evaluate(batch).extra["entropy"] > before
    with pytest.raises(ConfigError, match="entropy_coef"):
        GRPOConfig(entropy_coef=-0.1)
