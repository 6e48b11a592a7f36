"""The reference torch trainer ``GRPOTrainer``: GRPO advantages, the loss of ``objective``
over micro-batches of ``packing``, optimiser steps, exports and checkpoints.

Invariant: the forward pass is the engine's model code with dense causal attention, so under
the same weights ``logprobs`` equals the engine's behaviour logprobs up to fp32 rounding
(top-p / top-k sampling is not modelled); micro-batching gives the same gradient as one pass.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
from torch import Tensor

from agentroll._fs import atomic_dir
from agentroll.engine.models.decoder import DecoderModel, load_model
from agentroll.errors import ConfigError
from agentroll.trainer.base import TrainStats
from agentroll.trainer.batch import Batch
from agentroll.trainer.objective import Objective, kv_lag_terms, ppo_objective
from agentroll.trainer.packing import MIN_SHARED_PREFIX, _micro_batches, _TrainOps, common_prefix
from agentroll.weights.exporter import WeightExporter
from agentroll.weights.update import DTYPES, WeightUpdate, model_digest, state_checksums

_STATE_FORMAT = 1


class GRPOConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Static settings of :class:`GRPOTrainer` (``objective.ppo_objective`` states the loss).

    The loss is ``-sum(w_t J_t + b H_t)`` over loss tokens divided by their number
    (``loss_agg="token-mean"``), or the mean over sequences of their token means
    (``"seq-mean"``); ``J_t`` is ``ppo_objective``'s, ``w_t`` the kv-lag weight of
    ``kv_lag_terms``, ``H_t`` the entropy of the token's distribution and ``b`` the
    ``entropy_coef``."""

    lr: float = 1e-4  # AdamW
    weight_decay: float = 0.0  # on matrices only; norms and biases are never decayed
    betas: tuple[float, float] = (0.9, 0.999)
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: clip_eps (set higher for "clip-higher")
    is_cap: float = 5.0  # truncation C of the importance weight r
    kv_lag: Literal["weight", "cap", "mask"] = "weight"
    kv_lag_weight: float = 0.5  # per version of lag
    kv_lag_cap: float = 1.0  # C for kv-lagged tokens under kv_lag="cap"
    temperature: float = 1.0  # the sampling temperature: logprobs are of logits / T
    max_grad_norm: float | None = 1.0  # None: no clipping (the norm is still reported)
    # Tokens per forward/backward pass; sequences are packed into one stream.  Measured on
    # the tiny model, 64 x ~450 tokens, CPU: 1-2k tokens per pass ~10% faster than one
    # sequence per pass, 8k ~30% slower (activations fall out of cache).
    micro_batch_tokens: int = 2048
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    seed: int = 0
    export_dtype: str | None = None  # serving dtype of exports (e.g. "bfloat16"); None: fp32
    export: Literal["delta", "full"] = "delta"
    entropy_coef: float = 0.0  # bonus on the mean token entropy (policy-gradient steps only)

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"GRPOConfig: {msg}")

        if not self.lr > 0 or not self.weight_decay >= 0:
            raise bad("lr must be > 0 and weight_decay >= 0")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise bad(f"betas must be two values in [0, 1), got {self.betas}")
        if not 0 < self.clip_eps < 1:
            raise bad(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if not 0.0 <= self.entropy_coef < 1.0:
            raise bad(f"entropy_coef must be in [0, 1), got {self.entropy_coef}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise bad(f"clip_eps_high must be > 0 (or None), got {self.clip_eps_high}")
        if not self.is_cap >= 1:
            raise bad(f"is_cap must be >= 1 (on-policy tokens have weight 1), got {self.is_cap}")
        if self.kv_lag not in ("weight", "cap", "mask"):
            raise bad(f"kv_lag must be 'weight', 'cap' or 'mask', got {self.kv_lag!r}")
        if not 0 < self.kv_lag_weight <= 1:
            raise bad(f"kv_lag_weight must be in (0, 1], got {self.kv_lag_weight}")
        if not 0 < self.kv_lag_cap <= self.is_cap:
            raise bad(
                f"kv_lag_cap ({self.kv_lag_cap}) must be in (0, is_cap={self.is_cap}]: "
                "it is the tighter cap for kv-lagged tokens"
            )
        if not self.temperature > 0:
            raise bad("temperature must be > 0 (the sampling temperature of the rollouts)")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise bad("max_grad_norm must be > 0, or None to disable clipping")
        if self.micro_batch_tokens < 1:
            raise bad("micro_batch_tokens must be >= 1")
        if self.loss_agg not in ("token-mean", "seq-mean"):
            raise bad(f"loss_agg must be 'token-mean' or 'seq-mean', got {self.loss_agg!r}")
        if self.export_dtype is not None and self.export_dtype not in DTYPES:
            raise bad(f"export_dtype {self.export_dtype!r} unknown; use one of {sorted(DTYPES)}")
        if self.export not in ("delta", "full"):
            raise bad(f"export must be 'delta' or 'full', got {self.export!r}")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


class GRPOTrainer:
    """A torch trainer over the engine's own model code (implements :class:`Trainer`).

    ``GRPOTrainer(model_dir, GRPOConfig(...), version=0)`` loads fp32 master weights from a
    Hugging Face safetensors directory the engine can serve; ``version`` is the version the
    replicas give those weights.  ``clock`` times steps (inject one in tests).
    ``objective`` is the per-token objective of policy-gradient steps (``ppo_objective``;
    a trainer algorithm may bring another, see ``agentroll.trainer.algorithm``).  Not
    thread-safe: call it from one thread (e.g. with ``asyncio.to_thread``).
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: GRPOConfig | None = None,
        *,
        version: int = 0,
        device: str | torch.device = "cpu",
        clock: Callable[[], float] = time.perf_counter,
        objective: Objective = ppo_objective,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.objective = objective
        self.config = cfg = config if config is not None else GRPOConfig()
        self.device = torch.device(device)
        self.clock = clock
        self.model: DecoderModel = load_model(model_dir, dtype=torch.float32, device=self.device)
        self.model.train()
        self.params: dict[str, Tensor] = self.model.named_weights()
        matrices = [p for p in self.params.values() if p.ndim >= 2]
        vectors = [p for p in self.params.values() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": cfg.weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=cfg.betas,
        )
        # The trainer's own randomness (none in this loss; subclasses that sample use it), so
        # save/load can restore it without touching the process-wide torch RNG.
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.version = version
        mcfg = self.model.config
        self._inv_freq = 1.0 / (
            mcfg.rope_theta
            ** (torch.arange(0, mcfg.head_dim, 2, dtype=torch.float) / mcfg.head_dim)
        )
        self._cos = torch.empty(0, 1, mcfg.head_dim, device=self.device)
        self._sin = torch.empty(0, 1, mcfg.head_dim, device=self.device)
        self.exporter = self._new_exporter()

    # -- forward -------------------------------------------------------------------------

    def _new_exporter(self) -> WeightExporter:
        dtype = None if self.config.export_dtype is None else DTYPES[self.config.export_dtype][0]
        return WeightExporter(self.model.named_weights, version=self.version, dtype=dtype)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        need = int(positions.max()) + 1
        if self._cos.shape[0] < need:  # same values as the engine's tables (exact positions)
            size = max(need, 2 * self._cos.shape[0], 1024)
            freqs = torch.arange(size, dtype=torch.float)[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1).to(self.device)
            self._cos, self._sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def _hidden(self, batch: Batch, rows: Sequence[int]) -> tuple[Tensor, list[Tensor]]:
        """Final hidden states of ``rows`` packed into one stream, and for each row the
        stream index of each of its positions.  A prefix every row shares (the system
        prompt and tool schema of an agent task, typically most of its tokens) is computed
        once when it is at least ``MIN_SHARED_PREFIX`` tokens long."""
        lengths = [int(batch.lengths[r]) for r in rows]
        p = common_prefix(batch, rows)
        if p < MIN_SHARED_PREFIX:
            p = 0
        suffixes = [n - p for n in lengths]
        parts = [batch.input_ids[rows[0], :p]] if p else []
        parts += [batch.input_ids[r, p:n] for r, n in zip(rows, lengths, strict=True)]
        ids = torch.cat(parts)
        positions = torch.cat(
            ([torch.arange(p)] if p else []) + [torch.arange(p, n) for n in lengths]
        ).to(self.device)
        cos, sin = self._rope(positions)
        hidden = self.model(ids.to(self.device), cos, sin, _TrainOps(suffixes, prefix=p))
        where, at = [], p
        for m in suffixes:
            where.append(torch.cat((torch.arange(p), torch.arange(at, at + m))))
            at += m
        return hidden, where

    @property
    def _budget(self) -> int:
        return self.config.micro_batch_tokens

    @staticmethod
    def _budget_lengths(batch: Batch, lengths: Sequence[int]) -> list[int]:
        """Tokens each row adds to a micro-batch: the part after the prefix that all rows of
        the batch share (that prefix is computed once per micro-batch); 0 keeps a row out."""
        rows = [r for r, n in enumerate(lengths) if n > 0]
        p = common_prefix(batch, rows)
        if p < MIN_SHARED_PREFIX:
            p = 0
        return [max(1, n - p) if n > 0 else 0 for n in lengths]

    def _token_logprobs(
        self, hidden: Tensor, src_rows: Tensor, targets: Tensor, temperature: float
    ) -> Tensor:
        """Logprob of ``targets`` given the hidden states at ``src_rows`` (previous tokens)."""
        return self._token_logprobs_entropy(hidden, src_rows, targets, temperature, entropy="none")[
            0
        ]

    def _token_logprobs_entropy(
        self,
        hidden: Tensor,
        src_rows: Tensor,
        targets: Tensor,
        temperature: float,
        *,
        entropy: Literal["none", "value", "grad"],
    ) -> tuple[Tensor, Tensor | None]:
        """``_token_logprobs`` and the entropy of each token's (tempered) distribution:
        not computed (``none``), a statistic without gradient (``value``), or a loss term
        (``grad``)."""
        logits = self.model.logits(hidden.index_select(0, src_rows), _TrainOps([])).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(1, targets[:, None])[:, 0]
        if entropy == "none":
            return logp, None
        source = logp_all if entropy == "grad" else logp_all.detach()
        return logp, -(source.exp() * source).sum(-1)

    def _validate(self, batch: Batch) -> None:
        b, t = batch.input_ids.shape
        for name in (
            "attention_mask",
            "loss_mask",
            "behaviour_logprobs",
            "policy_version",
            "kv_version",
        ):
            if tuple(getattr(batch, name).shape) != (b, t):
                raise ValueError(f"batch.{name} has shape {tuple(getattr(batch, name).shape)}")
        if tuple(batch.advantages.shape) != (b,) or tuple(batch.lengths.shape) != (b,):
            raise ValueError("batch.advantages and batch.lengths need one value per row")
        cfg = self.model.config
        if t > cfg.max_position:
            raise ValueError(
                f"batch width {t} exceeds the model context {cfg.max_position}; "
                "collate with max_len"
            )
        if (
            b
            and t
            and (int(batch.input_ids.min()) < 0 or int(batch.input_ids.max()) >= cfg.vocab_size)
        ):
            raise ValueError(f"batch has token ids outside the vocabulary [0, {cfg.vocab_size})")
        if not bool(torch.isfinite(batch.advantages).all()):
            raise ValueError("batch.advantages must be finite")
        if b and (int(batch.lengths.min()) < 0 or int(batch.lengths.max()) > t):
            raise ValueError(f"batch.lengths must be in [0, {t}] (the batch width)")
        past_end = torch.arange(t)[None, :] >= batch.lengths[:, None]
        if bool((batch.loss_mask.bool() & past_end).any()):
            raise ValueError("batch.loss_mask marks tokens past a row's length (padding)")

    @torch.no_grad()
    def logprobs(self, batch: Batch, *, temperature: float | None = None) -> Tensor:
        """[B, T] float32 logprob of each token given its prefix under the current weights, of
        ``logits / temperature`` (default: the config's sampling temperature); 0 at position
        0 and on padding.  No gradient.  Raises ValueError for a malformed batch."""
        self._validate(batch)
        temp = self.config.temperature if temperature is None else temperature
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        lengths = batch.lengths.tolist()
        for rows in _micro_batches(self._budget_lengths(batch, lengths), self._budget):
            hidden, wheres = self._hidden(batch, rows)
            src, tgt, row_idx, pos_idx = [], [], [], []
            for r, where in zip(rows, wheres, strict=True):
                n = lengths[r]
                src.append(where[: n - 1])
                tgt.append(batch.input_ids[r, 1:n])
                row_idx.append(torch.full((n - 1,), r))
                pos_idx.append(torch.arange(1, n))
            lp = self._token_logprobs(
                hidden, torch.cat(src).to(self.device), torch.cat(tgt).to(self.device), temp
            )
            out[torch.cat(row_idx), torch.cat(pos_idx)] = lp.cpu()
        return out

    # -- training steps ------------------------------------------------------------------

    def step(self, batch: Batch) -> TrainStats:
        """One AdamW step of the clipped, truncated-IS policy gradient over ``batch``
        (micro-batched by ``micro_batch_tokens``); ``version`` grows by one.

        Raises ValueError (nothing changed) when the batch is malformed or a loss token lacks
        its behaviour logprob (NaN: use :meth:`sft_step` for demonstrations).
        """
        self._validate(batch)
        self._check_behaviour(batch)
        return self._run(batch, sft=False, update=True)

    def evaluate(self, batch: Batch, *, sft: bool = False) -> TrainStats:
        """The statistics :meth:`step` (or :meth:`sft_step`) would report on ``batch`` -- loss,
        ratios, clip fraction, kl -- without a gradient or an update (``version`` unchanged,
        ``grad_norm`` 0).  For validation batches and diagnostics."""
        self._validate(batch)
        if not sft:
            self._check_behaviour(batch)
        with torch.no_grad():
            return self._run(batch, sft=sft, update=False)

    def sft_step(self, batch: Batch) -> TrainStats:
        """One AdamW step of cross-entropy (plain logits, no temperature) on the loss tokens,
        aggregated by ``loss_agg``; for a supervised warm-up.  ``version`` grows by one."""
        self._validate(batch)
        return self._run(batch, sft=True, update=True)

    @staticmethod
    def _check_behaviour(batch: Batch) -> None:
        if not bool(torch.isfinite(batch.behaviour_logprobs[batch.loss_mask.bool()]).all()):
            raise ValueError(
                "batch has loss tokens without a behaviour logprob (NaN); the policy-gradient "
                "step needs the sampler's logprobs -- request them, or use sft_step"
            )

    def _run(self, batch: Batch, *, sft: bool, update: bool) -> TrainStats:
        cfg = self.config
        start = self.clock()
        loss_mask = batch.loss_mask.bool().clone()
        loss_mask[:, 0] = False  # the first token has no prefix to predict it from
        weight, cap, lagged = kv_lag_terms(batch.policy_version, batch.kv_version, cfg)
        lagged &= loss_mask
        if not sft and cfg.kv_lag == "mask":
            loss_mask &= ~lagged
        seq_tokens = loss_mask.sum(1)
        num_tokens, num_seqs = int(seq_tokens.sum()), int((seq_tokens > 0).sum())
        active = [
            n if k > 0 else 0
            for n, k in zip(batch.lengths.tolist(), seq_tokens.tolist(), strict=True)
        ]
        if update:
            self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        ratio_sum = kl_sum = 0.0
        ratio_max = entropy_sum = 0.0
        clipped = capped = have_ratio = 0
        for rows in _micro_batches(self._budget_lengths(batch, active), self._budget):
            hidden, wheres = self._hidden(batch, rows)
            src, tgt, row_of, pos_of = [], [], [], []
            for r, where in zip(rows, wheres, strict=True):
                pos = torch.nonzero(loss_mask[r]).flatten()
                src.append(where[pos - 1])
                tgt.append(batch.input_ids[r, pos])
                row_of.append(torch.full_like(pos, r))
                pos_of.append(pos)
            rows_t, pos_t = torch.cat(row_of), torch.cat(pos_of)
            temp = 1.0 if sft else cfg.temperature
            logp, entropy = self._token_logprobs_entropy(
                hidden,
                torch.cat(src).to(self.device),
                torch.cat(tgt).to(self.device),
                temp,
                entropy="grad" if cfg.entropy_coef and not sft and update else "value",
            )
            assert entropy is not None
            entropy_sum += float(entropy.detach().double().sum())
            mu = batch.behaviour_logprobs[rows_t, pos_t].to(self.device)
            if sft:
                per_token = -logp
            else:
                adv = batch.advantages[rows_t].to(self.device)
                objective, ratio, clip_active = self.objective(
                    logp,
                    mu,
                    adv,
                    cap[rows_t, pos_t].to(self.device),
                    clip_low=cfg.clip_eps,
                    clip_high=cfg.clip_high,
                )
                per_token = -objective * weight[rows_t, pos_t].to(self.device)
                if cfg.entropy_coef:
                    # a bonus for keeping the sampling distribution wide: without it a
                    # small policy can collapse onto one choice that groups then never
                    # contradict (every sample equal, every advantage 0)
                    per_token = per_token - cfg.entropy_coef * entropy
                log_ratio = (logp.detach() - mu).double()
                ratio_sum += float(ratio.double().sum())
                ratio_max = max(ratio_max, float(ratio.max()))
                kl_sum += float((torch.expm1(log_ratio) - log_ratio).sum())  # k3
                clipped += int(clip_active.sum())
                capped += int((ratio > cap[rows_t, pos_t].to(self.device)).sum())
                have_ratio += len(ratio)
            if cfg.loss_agg == "token-mean":
                loss = per_token.sum() / num_tokens
            else:
                per_seq = seq_tokens[rows_t].to(self.device, torch.float32)
                loss = (per_token / per_seq).sum() / num_seqs
            if update:
                loss.backward()
            total += float(loss.detach())
        grad_norm = 0.0
        if update:
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
            params = list(self.params.values())
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
        rewards = batch.rewards.double()
        n = max(have_ratio, 1)
        return TrainStats(
            version=self.version,
            loss=total,
            trajectories=batch.size,
            tokens=int(batch.loss_mask.sum()),
            reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
            reward_std=float(rewards.std(unbiased=False)) if len(rewards) else 0.0,
            clip_fraction=clipped / n,
            ratio_mean=ratio_sum / n,
            ratio_max=ratio_max,
            kl=kl_sum / n,
            grad_norm=grad_norm,
            kv_lagged_tokens=int(lagged.sum()),
            seconds=self.clock() - start,
            extra={
                "loss_tokens": float(num_tokens),
                "loss_sequences": float(num_seqs),
                "is_capped_fraction": capped / n,
                "truncated_tokens": float(batch.num_truncated),
                "lr": float(self.optimizer.param_groups[0]["lr"]),
                "sft": 1.0 if sft else 0.0,
                "entropy": entropy_sum / max(num_tokens, 1),
            },
        )

    # -- exports -------------------------------------------------------------------------

    def export(self, base_version: int | None = None) -> WeightUpdate:
        """The current weights (version ``self.version``) as a ``WeightUpdate``.

        A delta against the previous export when ``base_version`` is None or names that
        export's base (replacement values, so a replica at that version becomes bit-exact),
        a full update otherwise, or always with ``export="full"``.  Exporting again without a
        step returns the same update.
        """
        ex = self.exporter
        if ex.version != self.version:
            ex.export(self.version)
        if self.config.export == "full":
            return ex.full()
        if base_version is None:
            last = ex.last_delta
            return last if last is not None and last.version == self.version else ex.full()
        update = ex.update_for(base_version)
        return ex.full() if update is None else update

    def digest(self) -> str:
        """Whole-model digest of the current weights in the export dtype (what a replica at
        ``self.version`` reports after applying the exports)."""
        dtype = None if self.config.export_dtype is None else DTYPES[self.config.export_dtype][0]
        state = {
            n: (p.detach() if dtype is None else p.detach().to(dtype))
            for n, p in self.params.items()
        }
        return model_digest(state_checksums(state))

    # -- training state ------------------------------------------------------------------

    def _param_names(self) -> list[str]:
        """Checkpoint names in the optimizer's parameter order."""
        by_id = {id(p): n for n, p in self.params.items()}
        return [by_id[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def save(self, directory: str | Path) -> Path:
        """Write the training state (fp32 weights, AdamW moments and step counts, the
        trainer's RNG, version and config) to ``directory`` atomically: safetensors for
        tensors, JSON for the rest.  This is not an inference export (see save_pretrained)."""
        from safetensors.torch import save_file

        names = self._param_names()
        opt = self.optimizer.state_dict()
        opt_tensors: dict[str, Tensor] = {}
        keys: dict[str, list[str]] = {}
        for index, state in opt["state"].items():
            name = names[index]
            keys[name] = sorted(state)
            for key, value in state.items():
                t = value if isinstance(value, Tensor) else torch.tensor(value)
                opt_tensors[f"{name}:{key}"] = t.detach().cpu().contiguous()
        groups = [
            {k: v for k, v in g.items() if k != "params"}
            | {"params": [names[i] for i in g["params"]]}
            for g in opt["param_groups"]
        ]
        meta = {
            "format": _STATE_FORMAT,
            "version": self.version,
            "model_dir": str(self.model_dir),
            "config": msgspec.to_builtins(self.config),
            "param_groups": groups,
            "optimizer_keys": keys,
            "digest": model_digest(state_checksums(self.params)),
        }
        with atomic_dir(directory) as tmp:
            weights = {n: p.detach().cpu().contiguous() for n, p in self.params.items()}
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
            save_file({"generator": self.generator.get_state()}, str(tmp / "rng.safetensors"))
            (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        return Path(directory)

    def load(self, directory: str | Path) -> None:
        """Restore a state written by :meth:`save`: weights, optimizer moments and counts,
        RNG and version (hyperparameters come from the current config).  The exporter
        restarts from the loaded weights, so replicas at other versions get a full update.
        Raises ConfigError naming the file or tensor that does not fit this model."""
        from safetensors.torch import load_file

        root = Path(directory)
        try:
            meta: dict[str, Any] = json.loads((root / "trainer_state.json").read_text())
            weights = load_file(str(root / "model.safetensors"))
            opt_tensors = load_file(str(root / "optimizer.safetensors"))
            rng = load_file(str(root / "rng.safetensors"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{root}: not a trainer state written by save(): {exc}") from exc
        if meta.get("format") != _STATE_FORMAT:
            raise ConfigError(f"{root}: state format {meta.get('format')} is not {_STATE_FORMAT}")
        self._check_tensors(weights, root / "model.safetensors")
        names = self._param_names()
        index = {n: i for i, n in enumerate(names)}
        state: dict[int, dict[str, Tensor]] = {}
        for name, keys in meta["optimizer_keys"].items():
            if name not in index:
                raise ConfigError(f"{root}: optimizer state of unknown tensor {name!r}")
            state[index[name]] = {k: opt_tensors[f"{name}:{k}"] for k in keys}
        groups = []
        for saved, live in zip(meta["param_groups"], self.optimizer.param_groups, strict=True):
            group = {**saved, "params": [index[n] for n in saved["params"]]}
            # hyperparameters follow the current config, not the saved one
            group.update({k: live[k] for k in ("lr", "weight_decay", "betas")})
            groups.append(group)
        with torch.no_grad():
            for name, tensor in weights.items():
                self.params[name].copy_(tensor)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.generator.set_state(rng["generator"])
        self.version = int(meta["version"])
        self.exporter = self._new_exporter()

    def _check_tensors(self, tensors: Mapping[str, Tensor], where: Path) -> None:
        if set(tensors) != set(self.params):
            odd = sorted(set(tensors) ^ set(self.params))
            raise ConfigError(f"{where}: tensor {odd[0]!r} does not match this model's tensors")
        for name, t in tensors.items():
            if t.shape != self.params[name].shape:
                raise ConfigError(
                    f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the model has "
                    f"{tuple(self.params[name].shape)}"
                )

    def save_pretrained(self, directory: str | Path, *, dtype: str | None = None) -> Path:
        """Write a Hugging Face style checkpoint the engine (and transformers) can load:
        ``config.json`` (``torch_dtype`` updated), ``model.safetensors`` under checkpoint
        names in ``dtype`` (default: ``export_dtype``, else float32) and every other file of
        ``model_dir`` (tokenizer, generation config), atomically."""
        from safetensors.torch import save_file

        name = dtype or self.config.export_dtype or "float32"
        if name not in DTYPES or not DTYPES[name][0].is_floating_point:
            raise ConfigError(f"save_pretrained: dtype {name!r} is not a float dtype")
        config = json.loads((self.model_dir / "config.json").read_text())
        config["torch_dtype"] = name
        config.pop("dtype", None)
        with atomic_dir(directory) as tmp:
            for src in sorted(self.model_dir.iterdir()):
                skip = src.suffix in (".safetensors", ".bin", ".pt", ".pth") or src.name in (
                    "config.json",
                    "model.safetensors.index.json",
                )
                if src.is_file() and not skip:
                    shutil.copy2(src, tmp / src.name)
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            cast = {
                n: p.detach().to("cpu", DTYPES[name][0]).contiguous()
                for n, p in self.params.items()
            }
            save_file(cast, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return Path(directory)
