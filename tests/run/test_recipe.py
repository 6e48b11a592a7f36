"""Recipes: validation names the field, the dump round-trips, run directories record a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentroll.errors import ConfigError
from agentroll.run.recipe import Recipe, create_run_dir, dump_recipe, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_round_trip() -> None:
    recipe = parse_recipe('[sync]\nstrategy = "pause"\n[buffer]\nmax_staleness = 0\n')
    assert recipe.sync.strategy == "pause" and recipe.buffer.max_staleness == 0
    assert recipe.trainer == Recipe().trainer
    assert parse_recipe(dump_recipe(recipe)) == recipe


def test_unbounded_staleness_round_trips() -> None:
    recipe = parse_recipe('[buffer]\nmax_staleness = "none"\n')
    assert recipe.buffer.max_staleness is None
    assert parse_recipe(dump_recipe(recipe)) == recipe


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[sync]\nstrategy = "sometimes"', "sync.strategy"),
        ("[sync]\nstrateg = 1", "strateg"),
        ("[trainer]\nbatch_size = 6", "trainer.batch_size"),
        ("[run]\nsteps = 0", "run.steps"),
        ("[sampling]\ntop_p = 1.5", "sampling.top_p"),
        ("[warmup]\nsteps = 3", "warmup.expert"),
        ("[buffer]\nmax_staleness = -1", "buffer.max_staleness"),
        ("[nonsense]\nx = 1", "nonsense"),
        ('[backend]\nreplicas = "two"', "backend.replicas"),
        ("[rollout]\nsamples_per_task = 0", "rollout.samples_per_task"),  # was a ZeroDivisionError
    ],
)
def test_errors_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_recipe(text, source="r.toml")
    assert field in str(info.value) and str(info.value).startswith("r.toml: ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[sync]\nstrategy = "sometimes"', "sync.strategy: Invalid enum value 'sometimes'"),
        ("[sync]\nstrateg = 1", "sync: Object contains unknown field `strateg`"),
        ('[backend]\nreplicas = "two"', "backend.replicas: Expected `int`, got `str`"),
        ("[rollout]\nconcurrency = 0", "rollout.concurrency = 0 is out of range; use 1..65536"),
        ("[sampling]\ntop_p = 0", "sampling.top_p = 0.0 is out of range; use (0, 1]"),
    ],
)
def test_errors_lead_with_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_recipe(text, source="r.toml")
    assert str(info.value).startswith(f"r.toml: {message}"), str(info.value)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_recipe("x = ")
    with pytest.raises(ConfigError, match="cannot read recipe"):
        load_recipe(tmp_path / "absent.toml")


def test_relative_paths_resolve_against_the_recipe(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "r.toml"
    path.write_text(
        '[run]\nout_dir = "out"\n[environment]\nkwargs = { traces = "../t.jsonl", seed = 3 }\n'
    )
    recipe = load_recipe(path)
    assert recipe.run.out_dir == str(tmp_path / "sub" / "out")
    assert recipe.environment.kwargs == {"traces": str(tmp_path / "t.jsonl"), "seed": 3}


def test_demo_recipe_is_valid() -> None:
    recipe = load_recipe(REPO / "examples" / "recipes" / "demo.toml")
    assert recipe.backend.replicas == 2 and recipe.sync.policy == "keep"
    assert recipe.buffer.max_staleness == 1 and recipe.sync.encoding == "delta"
    assert Path(recipe.environment.kwargs["traces"]).is_file()


def test_run_dir_records_the_run(tmp_path: Path) -> None:
    recipe = parse_recipe("[run]\nseed = 5\n")
    out = create_run_dir(recipe, run_dir=tmp_path / "run")
    assert parse_recipe((out / "recipe.toml").read_text()) == recipe
    assert json.loads((out / "seeds.json").read_text())["run"] == 5
    assert "torch" in json.loads((out / "versions.json").read_text())
    with pytest.raises(ConfigError, match="already holds a run"):
        create_run_dir(recipe, run_dir=out)


def test_docker_sandbox_settings_reach_the_environment() -> None:
    from agentroll.run.build import build_environment

    recipe = parse_recipe(
        '[sandbox]\nbackend = "docker"\nmemory_mb = 512\n'
        'options = { docker_host = "unix:///x.sock", pool_size = 4, create_rate = 0.5 }\n'
    )
    assert parse_recipe(dump_recipe(recipe)) == recipe
    config = build_environment(recipe).sandbox_config
    assert config is not None and config.backend == "docker" and config.memory_mb == 512
    assert config.options == {"docker_host": "unix:///x.sock", "pool_size": 4, "create_rate": 0.5}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[sandbox]\nbackend = "docker"\noptions = { pool_sise = 4 }', "pool_sise"),
        ('[sandbox]\nbackend = "docker"\noptions = { ttl = "long" }', "sandbox.options.ttl"),
        ("[sandbox]\noptions = { cpus = 1.0 }", "sandbox.options"),
        ('[sandbox]\nbackend = "docker"\nmemory_mb = 1', "sandbox.memory_mb"),
    ],
)
def test_sandbox_option_errors_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_recipe(text, source="r.toml")
    assert field in str(info.value), str(info.value)


def test_backend_kinds_build_their_replicas(tmp_path: Path) -> None:
    from agentroll.backends.vllm import VLLMBackend
    from agentroll.backends.vllm_server import VLLMServerBackend
    from agentroll.run.build import build_backend

    fleet: Any = build_backend(parse_recipe('[backend]\nkind = "vllm"\nreplicas = 2\n'), tmp_path)
    assert [type(r.backend) for r in fleet.replicas.values()] == [VLLMBackend, VLLMBackend]
    recipe = parse_recipe(
        '[backend]\nkind = "http"\nreplicas = 2\n'
        'urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]\n'
    )
    fleet = build_backend(recipe, tmp_path)
    assert [r.backend.base_url for r in fleet.replicas.values()] == recipe.backend.urls
    assert all(isinstance(r.backend, VLLMServerBackend) for r in fleet.replicas.values())
    with pytest.raises(ConfigError, match=r"backend\.urls"):
        parse_recipe('[backend]\nkind = "http"\nreplicas = 2\nurls = ["http://x"]\n')
    recipe = parse_recipe(
        '[backend]\nkind = "vllm"\nreplicas = 2\nweight_transfer = "sparse_nccl"\n'
        'transfer_devices = ["cuda:2", "cuda:3"]\nprobe_tokens = 0\nverify_served = false\n'
    )
    fleet = build_backend(recipe, tmp_path)
    engines = [r.backend for r in fleet.replicas.values()]
    assert [(e.transfer, e.transfer_device) for e in engines] == [
        ("sparse_nccl", "cuda:2"),
        ("sparse_nccl", "cuda:3"),
    ]
    assert all(e.check.probe_tokens == 0 and not e.check.verify_served for e in engines)
    with pytest.raises(ConfigError, match="transfer_devices"):
        parse_recipe('[backend]\nkind = "vllm"\nweight_transfer = "nccl"\n')


def test_the_staleness_rule_is_a_recipe_policy() -> None:
    from agentroll.rollout.pause import EpisodeView
    from agentroll.run.build import resume_policy

    recipe = parse_recipe('[sync]\npolicy = "staleness"\nmax_kv_lag = 1\nafter = "restart"\n')
    choose = resume_policy(recipe.sync)
    assert callable(choose)

    def view(min_kv: int, target: int) -> EpisodeView:
        return EpisodeView(
            episode_id="e", request_id="r", turn=0, tokens_generated=3,
            min_policy_version=min_kv, min_kv_version=min_kv, policy_version=target - 1,
            target_version=target,
        )  # fmt: skip

    assert choose(view(2, 3)) == "keep" and choose(view(1, 3)) == "restart"
    assert resume_policy(parse_recipe("").sync) == "keep"
    with pytest.raises(ConfigError, match="max_kv_lag"):
        parse_recipe('[sync]\npolicy = "staleness"\nmax_kv_lag = -1\n')
