import gc
import json
import pickle
from pathlib import Path

import pytest
import torch

from agentroll.backends.base import SamplingParams
from agentroll.engine.engine import EngineConfig, LLMEngine
from agentroll.engine.snapshot import RequestSnapshot
from agentroll.errors import ConfigError


def run(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    until: int | None = None,
) -> dict[str, list]:
    out: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_work() and (until is None or steps < until):
        for o in engine.step():
            out[o.request_id].append(o)
        steps += 1
    return out


def prompt(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module", params=[True, False], ids=["kernels", "torch"])
def engine(tiny_model: Path, request: pytest.FixtureRequest) -> LLMEngine:
    """The engine on the C++ CPU kernels and on plain torch ops: every test runs on both."""
    return LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=512, cpu_kernels=request.param))


P = SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)


def test_same_seed_same_output_and_versions(engine: LLMEngine) -> None:
    a = run(engine, {"a": (prompt(engine, "hi"), P)})["a"]
    b = run(engine, {"b": (prompt(engine, "hi"), P)})["b"]
    assert [o.token_id for o in a] == [o.token_id for o in b] and len(a) == 24
    assert [o.logprob for o in a] == [o.logprob for o in b]
    assert a[-1].finish_reason == "length" and all(o.policy_version == o.kv_version == 0 for o in a)


def test_snapshot_to_disk_and_restore_continues_exactly(engine: LLMEngine, tmp_path: Path) -> None:
    ref = run(engine, {"r": (prompt(engine, "snapshot me"), P)})["r"]
    part = run(engine, {"r": (prompt(engine, "snapshot me"), P)}, until=9)["r"]
    engine.pause_all()
    engine.snapshot("r").save(tmp_path / "snap")
    engine.abort("r")
    engine.restore(RequestSnapshot.load(tmp_path / "snap"))
    tail: list = []
    while engine.has_work():
        tail += engine.step()
    got = part + tail
    assert [(o.token_id, o.logprob) for o in got] == [(o.token_id, o.logprob) for o in ref]


def test_a_held_snapshot_continues_exactly_in_another_engine_and_is_released(
    tiny_model: Path, tmp_path: Path
) -> None:
    """``snapshot_many(hold_kv=...)`` keeps the KV blocks where they are (no copy while the
    replica stands paused); the engine that restores the request reads them, and the blocks
    go back to the first engine through the callback.  A hold nobody reads is released when
    it is dropped; a held snapshot saved to disk holds its KV in the file."""
    cfg = EngineConfig(model=str(tiny_model), num_blocks=128)
    src, dst = LLMEngine(cfg), LLMEngine(cfg)
    ref = run(dst, {"r": (prompt(dst, "move me"), P)})["r"]
    part = run(src, {"r": (prompt(src, "move me"), P)}, until=9)["r"]
    used = src.scheduler.block_manager.num_used_blocks
    released: list[list[int]] = []
    src.pause_all()
    snap = src.snapshot_many(["r"], hold_kv=released.append)["r"]
    assert snap.k is None and snap.kv_hold is not None and snap.num_computed_tokens > 0
    src.abort("r")
    assert src.scheduler.block_manager.num_used_blocks == used  # held, not freed
    with pytest.raises(TypeError, match="cannot leave its process"):
        pickle.dumps(snap)
    # the consumer got 3 tokens fewer than were sampled: it continues from what it has
    # (the hold has more blocks than that needs; only the needed ones are read)
    kept = len(part) - 3
    dst.restore(snap.truncated(kept))
    assert len(released) == 1  # read, then handed back
    src.release_blocks(released[0])
    assert src.scheduler.block_manager.num_used_blocks == 0
    tail: list = []
    while dst.has_work():
        tail += dst.step()
    got = part[:kept] + tail
    assert [(o.token_id, o.logprob) for o in got] == [(o.token_id, o.logprob) for o in ref]
    # dropped unread: released all the same; saved: the file holds the KV
    run(src, {"s": (prompt(src, "move me"), P)}, until=5)
    src.pause_all()
    dropped = src.snapshot_many(["s"], hold_kv=released.append)["s"]
    saved = src.snapshot_many(["s"], hold_kv=released.append)["s"]
    del dropped
    gc.collect()
    assert len(released) == 2
    saved.save(tmp_path / "held")
    assert len(released) == 2  # saving reads the KV and keeps the hold: still restorable
    loaded = RequestSnapshot.load(tmp_path / "held")
    assert loaded.k is not None and loaded.kv_hold is None
    k, v = saved.materialized(release=False).k, saved.materialized(release=False).v
    assert k is not None and v is not None
    assert torch.equal(loaded.k, k) and torch.equal(loaded.v, v)
    del saved
    gc.collect()
    assert len(released) == 3
    for blocks in released[1:]:
        src.release_blocks(blocks)
    src.abort("s")
    assert src.scheduler.block_manager.num_used_blocks == 0


def test_a_refused_held_snapshot_hands_its_blocks_back_at_once(tiny_model: Path) -> None:
    """A target that refuses a held snapshot (the request runs there already, or its KV
    does not fit now) hands the hold back at once, though the snapshot stays referenced (a
    traceback's frame or a log record keeps it in a fleet): the source's blocks are not
    kept until a garbage collection.  Restored again, it recomputes its KV, exactly."""
    cfg = EngineConfig(model=str(tiny_model), num_blocks=128)
    src, dst = LLMEngine(cfg), LLMEngine(cfg)
    ref = run(dst, {"r": (prompt(dst, "refuse me"), P)})["r"]
    part = run(src, {"r": (prompt(src, "refuse me"), P)}, until=9)["r"]
    released: list[list[int]] = []
    src.pause_all()
    snap = src.snapshot_many(["r"], hold_kv=released.append)["r"]
    assert snap.kv_hold is not None
    src.abort("r")
    run(dst, {"r": (prompt(dst, "refuse me"), P)}, until=2)  # "r" runs there already
    with pytest.raises(ValueError, match="already running"):
        dst.restore(snap)
    assert len(released) == 1 and not snap.kv_hold.alive  # handed back, not garbage-collected
    assert not snap.has_kv
    src.release_blocks(released[0])
    assert src.scheduler.block_manager.num_used_blocks == 0
    dst.abort("r")
    dst.restore(snap)  # its hold is gone: the KV is computed again, the tokens the same
    tail: list = []
    while dst.has_work():
        tail += dst.step()
    got = part + tail
    assert [(o.token_id, o.logprob) for o in got] == [(o.token_id, o.logprob) for o in ref]
    assert len(released) == 1
    # no room for its KV there now: refused, and handed back all the same
    run(src, {"s": (prompt(src, "refuse me"), P)}, until=9)
    src.pause_all()
    held = src.snapshot_many(["s"], hold_kv=released.append)["s"]
    small = LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=4))
    run(small, {"big": (prompt(small, "a long prompt that fills three blocks " * 2), P)}, until=2)
    assert small.scheduler.block_manager.num_free_blocks < 2
    with pytest.raises(ValueError, match="not enough free KV blocks"):
        small.restore(held)
    assert len(released) == 2
    src.release_blocks(released[1])
    src.abort("s")
    assert src.scheduler.block_manager.num_used_blocks == 0


def test_restart_policy_replays_the_turn(engine: LLMEngine) -> None:
    ref = run(engine, {"x": (prompt(engine, "restart"), P)})["x"]
    part = run(engine, {"x": (prompt(engine, "restart"), P)}, until=6)["x"]
    engine.pause_all()
    assert engine.resume_all("restart") == {"x": len(part)}
    again: list = []
    while engine.has_work():
        again += engine.step()
    assert [(o.token_id, o.logprob) for o in again] == [(o.token_id, o.logprob) for o in ref]


def test_too_long_prompt_fails_only_that_request(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=64, max_model_len=100))
    out = run(engine, {"long": ([5] * 150, P), "ok": (prompt(engine, "fine"), P)})
    assert out["long"][0].error and "context length" in out["long"][0].error
    assert len(out["ok"]) == 24 and out["ok"][-1].finish_reason == "length"


def test_kv_pool_exhaustion_preempts_instead_of_failing(tiny_model: Path) -> None:
    small = LLMEngine(
        EngineConfig(model=str(tiny_model), num_blocks=12, block_size=16, batch_invariant=True)
    )
    reqs = {
        f"r{i}": (
            prompt(small, f"pressure {i}"),
            SamplingParams(temperature=1.0, max_tokens=40, seed=i, ignore_eos=True),
        )
        for i in range(6)
    }
    out = run(small, reqs)
    assert small.scheduler.num_preemptions > 0
    assert all(len(v) == 40 and v[-1].finish_reason == "length" for v in out.values())
    big = LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=512, batch_invariant=True))
    ref = run(big, reqs)
    assert {k: [o.token_id for o in v] for k, v in out.items()} == {
        k: [o.token_id for o in v] for k, v in ref.items()
    }


def test_corrupt_snapshot_is_refused(engine: LLMEngine, tmp_path: Path) -> None:
    run(engine, {"c": (prompt(engine, "corrupt"), P)}, until=4)
    engine.pause_all()
    engine.snapshot("c").save(tmp_path / "snap")
    engine.resume_all()
    (tmp_path / "snap" / "kv.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"kv\.safetensors"):
        RequestSnapshot.load(tmp_path / "snap")
    (tmp_path / "snap" / "meta.msgpack").write_bytes(b"\xc1")
    with pytest.raises(ValueError, match=r"meta\.msgpack"):
        RequestSnapshot.load(tmp_path / "snap")
    rest: list = []
    while engine.has_work():
        rest += engine.step()
    assert rest[-1].finish_reason == "length"  # the live request is unaffected


def test_stop_tokens_and_strings(engine: LLMEngine) -> None:
    ref = run(engine, {"s": (prompt(engine, "stops"), P)})["s"]
    stop_at = ref[5].token_id
    out = run(
        engine,
        {
            "s": (
                prompt(engine, "stops"),
                SamplingParams(
                    temperature=1.0,
                    max_tokens=24,
                    seed=5,
                    ignore_eos=True,
                    stop_token_ids=(stop_at,),
                ),
            )
        },
    )["s"]
    first = next(i for i, o in enumerate(ref) if o.token_id == stop_at)
    assert len(out) == first + 1 and out[-1].finish_reason == "stop"
    text = engine.tokenizer.decode([o.token_id for o in ref[:8]])
    needle = text[-3:]
    out = run(
        engine,
        {
            "s": (
                prompt(engine, "stops"),
                SamplingParams(
                    temperature=1.0, max_tokens=24, seed=5, ignore_eos=True, stop=(needle,)
                ),
            )
        },
    )["s"]
    assert out[-1].finish_reason == "stop" and len(out) <= 8


def test_score_matches_sampling_logprobs(engine: LLMEngine) -> None:
    p = prompt(engine, "score")
    out = run(engine, {"z": (p, P)})["z"]
    ids = p + [o.token_id for o in out]
    scored = engine.score(ids)[len(p) - 1 :]
    assert max(abs(a - o.logprob) for a, o in zip(scored, out, strict=True)) < 1e-5


def test_missing_model_dir_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="create-tiny"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def _damaged(tiny_model: Path, tmp_path: Path, name: str, text: str | None) -> Path:
    """A copy of the tiny model with ``name`` replaced by ``text`` (or one field changed:
    ``text`` = ``"key=json"``)."""
    for f in tiny_model.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    if text is not None and "=" in text and not text.startswith(("{", "[")):
        key, value = text.split("=", 1)
        data = json.loads((tmp_path / name).read_text())
        data[key] = json.loads(value)
        text = json.dumps(data)
    (tmp_path / name).write_text(text or "")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("config.json", "[1]", r"config\.json: expected a JSON object"),  # AttributeError
        ("config.json", 'hidden_size="64"', "'hidden_size' must be an integer"),  # TypeError
        ("config.json", "{nope", r"config\.json: cannot read JSON"),  # JSONDecodeError
        ("tokenizer.json", "{nope", r"tokenizer\.json is not a readable tokenizer"),  # Exception
        ("tokenizer.json", "", r"tokenizer\.json is not a readable tokenizer"),
        ("tokenizer_config.json", "[]", r"tokenizer_config\.json: expected a JSON object"),
        ("tokenizer_config.json", 'chat_template="{% if %}"', "chat template does not compile"),
        ("tokenizer_config.json", "chat_template=5", "chat_template must be a string"),
        ("tokenizer_config.json", "eos_token=7", "eos_token must be a string"),
        ("generation_config.json", "{nope", r"generation_config\.json: cannot read JSON"),
        ("generation_config.json", 'eos_token_id=["a"]', "eos_token_id 'a' is not a token id"),
        ("generation_config.json", "eos_token_id=-5", "eos_token_id -5 is not a token id"),  # kept
        ("generation_config.json", "eos_token_id=1000000000", "is not a token id"),
    ],
)
def test_a_damaged_model_directory_is_a_config_error_naming_the_file(
    tiny_model: Path, tmp_path: Path, name: str, text: str, match: str
) -> None:
    model = _damaged(tiny_model, tmp_path, name, text)
    with pytest.raises(ConfigError, match=match):
        LLMEngine(EngineConfig(model=str(model)))


@pytest.mark.parametrize("path", ["delta", "staged", "load_weights"])
def test_every_weight_update_path_reaches_the_computation(tiny_model: Path, path: str) -> None:
    """The engine derives data from the weights (the kernels' transposed copies); after an
    update through any path its logits equal those of an engine started on the new weights."""
    from agentroll.engine.models.decoder import read_tensors
    from agentroll.weights.exporter import WeightExporter

    base = read_tensors(tiny_model)
    new = {
        n: t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
        for n, t in base.items()
    }
    prompt = list(range(30, 60))

    def logits(e: LLMEngine) -> torch.Tensor:
        return torch.tensor(e.score(prompt))

    engine = LLMEngine(EngineConfig(model=str(tiny_model)))
    before = logits(engine)  # derived copies now exist for the old weights
    if path == "load_weights":
        engine.load_weights(new)
    else:
        live = dict(base)
        exporter = WeightExporter(lambda: live)
        live.update(new)
        update = exporter.export()
        assert update.kind == "delta" or path == "staged"
        if path == "delta":
            engine.apply_update(update)
        else:
            engine.commit_staged(engine.stage_update(update))
    fresh = LLMEngine(EngineConfig(model=str(tiny_model)))
    fresh.load_weights(new)
    after = logits(engine)
    assert not torch.equal(after, before)
    assert torch.equal(after, logits(fresh))
    # decodes too (with the kernels they run in decoder_forward, over its own fused copies)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    sampled = [
        [(o.token_id, o.logprob) for o in run(e, {"d": (prompt, params)})["d"]]
        for e in (engine, fresh)
    ]
    assert sampled[0] == sampled[1]


def test_decode_steps_run_the_whole_model_in_one_kernel_call(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernels, a step of decodes and short prefill chunks is one ``decoder_forward``
    call; a step with a long prefill is not (fast mode), and in the batch-invariant mode
    every step is."""
    from agentroll.engine import kernels
    from agentroll.engine.model_runner import _FUSED_PREFILL_KEYS, ModelRunner

    if kernels.get() is None:
        pytest.skip("the CPU kernels could not be built here")
    calls: list[bool] = []
    fused = ModelRunner._forward_fused

    def counted(self: ModelRunner, plan: object, weights: object) -> object:
        calls.append(plan.all_decodes)  # type: ignore[attr-defined]
        return fused(self, plan, weights)  # type: ignore[arg-type]

    monkeypatch.setattr(ModelRunner, "_forward_fused", counted)
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=1, ignore_eos=True)
    short = {"a": (list(range(40, 60)), params), "b": (list(range(7, 9)), params)}
    long = [t % 900 + 10 for t in range(400)]  # 400 x 200 keys: over the bound
    assert _FUSED_PREFILL_KEYS < 400 * 200
    for invariant, requests, fused_steps in [
        (False, short, "all"),
        (False, {"c": (long, params)}, "all but the first"),
        (True, {"c": (long, params)}, "all"),
    ]:
        calls.clear()
        e = LLMEngine(EngineConfig(model=str(tiny_model), batch_invariant=invariant))
        out = run(e, requests)
        assert all(len(v) == 5 for v in out.values())
        steps = e.num_steps
        if fused_steps == "all":
            assert len(calls) == steps and not calls[0]  # the first step prefills
        else:
            assert calls == [True] * (steps - 1)


@pytest.mark.parametrize("chars", [7, 150], ids=["one-chunk", "chunked"])
def test_a_group_of_identical_prompts_prefills_once_and_samples_as_alone(
    tiny_model: Path, chars: int
) -> None:
    """Samples of one prompt fork the KV of the first one's prefill (its partial block
    copied) and sample their first token from its logits: in batch-invariant mode every
    token and logprob is what they sample with sharing off, and the prompt is computed once."""

    def engine(share: bool) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(tiny_model),
                num_blocks=256,
                batch_invariant=True,
                max_num_batched_tokens=64,  # the longer prompt prefills in chunks
                share_group_prefill=share,
            )
        )

    on, off = engine(True), engine(False)
    text = "group " + "x" * chars
    group = {
        f"g{i}": (prompt(on, text), SamplingParams(temperature=1.0, max_tokens=12, seed=i))
        for i in range(4)
    }
    other = {"solo": (prompt(on, "another prompt"), SamplingParams(max_tokens=12, seed=9))}
    n = len(prompt(on, text))
    assert n % 16 != 0 and (n > 64) == (chars > 64)  # a partial last block; chunks
    got, ref = run(on, {**group, **other}), run(off, {**group, **other})
    assert {k: [(o.token_id, o.logprob) for o in v] for k, v in got.items()} == {
        k: [(o.token_id, o.logprob) for o in v] for k, v in ref.items()
    }
    assert len({tuple(o.token_id for o in got[k]) for k in group}) > 1  # samples differ
    assert on.scheduler.num_shared_tokens == 3 * n and off.scheduler.num_shared_tokens == 0
    assert on.scheduler.block_manager.num_used_blocks == 0  # every reference dropped


def test_default_threads_split_only_models_big_enough_to_pay() -> None:
    from agentroll.engine.engine import default_threads
    from agentroll.engine.models.decoder import DecoderConfig
    from agentroll.model.shapes import SHAPES, shape_config

    def config(name: str) -> DecoderConfig:
        return DecoderConfig.from_dict(shape_config(SHAPES[name]))

    assert default_threads(config("tiny")) == 1
    for name in ("smollm2-360m", "llama-1b"):
        assert default_threads(config(name)) == torch.get_num_threads()
