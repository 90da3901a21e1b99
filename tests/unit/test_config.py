"""Job config: YAML plus dotted overrides, unknown keys and bad values named precisely."""

import pytest

from bapo_megatron.algo.bapo import PRESETS
from bapo_megatron.config import MOVED, JobConfig, build, dump_config, load_config, parse_override, parse_stop_when
from bapo_megatron.config.loader import STILL_READ
from bapo_megatron.errors import ConfigError


def test_defaults_are_the_spec_defaults():
    cfg = load_config()
    assert cfg.algo.loss == "bapo"
    assert cfg.algo.bapo == PRESETS["seed"]
    assert (cfg.algo.bapo.low_start, cfg.algo.bapo.high_max, cfg.algo.bapo.target_rho) == (0.6, 3.0, 0.5)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("steps: 5\nalgo:\n  bapo:\n    preset: paper\n    dual_clip: 3\noptimizer:\n  lr: 1e-5\n")
    cfg = load_config(path, ["algo.bapo.target_rho=0.45", "parallel.tensor=2", "logging.backends=[console]"])
    assert cfg.steps == 5 and cfg.optimizer.lr == 1e-5
    assert cfg.algo.bapo.target_rho == 0.45 and cfg.algo.bapo.dual_clip == 3.0
    assert cfg.parallel.tensor == 2 and cfg.logging.backends == ("console",)
    # Preset first, explicit keys on top, whatever their order.
    cfg = load_config(None, ["algo.bapo.low_step=0.01", "algo.bapo.preset=verl_example"])
    assert cfg.algo.bapo.low_step == 0.01 and cfg.algo.bapo.search_order == "lower_first"


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["algo.loss=gspo", "rollout.partial.enabled=true", "rollout.partial.token_budget=16"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.bapo.traget_rho=0.4", "algo.bapo.traget_rho: unknown key; did you mean 'target_rho'?"),
        ("algo.bapoo.target_rho=0.4", "algo.bapoo: unknown key; did you mean 'bapo'?"),
        ("algo.bapo.target_rho=1.5", "algo.bapo.target_rho=1.5: must lie in (0, 1)"),
        ("algo.bapo.low_start=0.95", "algo.bapo.low_start=0.95: must not exceed low_max=0.9"),
        ("algo.bapo.high_step=0", "algo.bapo.high_step=0.0: must be a positive finite number"),
        ("algo.loss=ppo_", "algo.loss='ppo_': must be one of"),
        ("parallel.tensor=two", "parallel.tensor='two': must be an integer"),
        ("parallel.tensor=1.5", "parallel.tensor=1.5: must be an integer"),
        ("rollout.partial.enabled=maybe", "rollout.partial.enabled='maybe': must be true or false"),
        ("rollout.partial=true", "rollout.partial=True: must be a mapping of PartialConfig fields"),
        ("rollout.token_budget=8", "rollout.token_budget: unknown key; moved to rollout.partial.token_budget"),
        ("model.precision=fp8", "model.precision='fp8': fp8 needs transformer_impl='transformer_engine'"),
        ("rollout.partial.token_budget=8", "rollout.partial.token_budget=8: only applies with enabled=true"),
        ("steps.x=1", "steps.x=1: 'steps' is a value, not a section"),
        ("algo.bapo.preset=fast", "algo.bapo.preset='fast': must be one of"),
        ("logging.backends=[console, mlflow]", "logging.backends[1]='mlflow': must be one of"),
        ("algo.updates_per_batch=3", "algo.updates_per_batch=3: must divide rollout.prompts_per_step=8"),
        ("reward.workers=0", "reward.workers=0: must be >= 1"),
        ("reward.range=[1, -1]", "reward.range=[1.0, -1.0]: needs low < high"),
        ("reward.by=data_source", "reward.table={}: goes with by (both or neither)"),
        ("reward.overlong_buffer=65", "reward.overlong_buffer=65: must not exceed rollout.sampling.max_new_tokens=64"),
        ("reward.max_failure_share=1", "reward.max_failure_share=1.0: must be in [0, 1)"),
        ("noequals", "override='noequals'"),
    ],
)
def test_bad_values_name_field_and_value(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "typo.yaml").write_text("rollout:\n  sampling:\n    temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.temprature: unknown key; did you mean .temperature."):
        load_config(tmp_path / "typo.yaml")


def test_parallel_sizes_against_world():
    cfg = build(JobConfig, {"parallel": {"tensor": 2, "pipeline": 2}}).parallel
    assert cfg.data_parallel_size(8) == 2
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        cfg.data_parallel_size(6)


def test_parse_override_reads_yaml_scalars():
    assert parse_override("a.b=0.4") == ("a.b", 0.4)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=[1, 2]") == ("a", [1, 2])
    assert parse_override("a=text") == ("a", "text")


def test_every_example_config_loads():
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        load_config(path)


def test_round_calls_are_refused_where_a_step_cuts_or_replaces_requests():
    for overrides, phrase in (
        (["rollout.oversample=1.5"], "waits for every group it draws"),
        (["rollout.filter_groups.enabled=true"], "waits for every group it draws"),
        (["rollout.mode=async"], "applies to mode=sync with partial.mode=abort"),
        (["rollout.partial.enabled=true", "rollout.partial.mode=retract"], "applies to mode=sync"),
    ):
        with pytest.raises(ConfigError, match=f"rollout.calls='round': .*{phrase}"):
            load_config(None, ["rollout.calls=round", *overrides])
    deterministic = ["rollout.calls=round", "rollout.oversample=1.5", "rollout.deterministic=true"]
    assert load_config(None, deterministic).rollout.round_calls
    assert load_config(None, []).rollout.round_calls  # auto on the embedded engine
    assert not load_config(None, ["rollout.engines.kind=sglang"]).rollout.round_calls


def test_partial_budget_must_reach_max_new_tokens_before_staleness():
    with pytest.raises(ConfigError, match=r"rollout.partial.token_budget=8: x \(max_staleness \+ 1\) = 40 tokens"):
        load_config(
            None,
            ["rollout.partial.enabled=true", "rollout.sampling.max_new_tokens=64", "rollout.partial.token_budget=8"],
        )
    cfg = load_config(
        None,
        [
            "rollout.partial.enabled=true",
            "rollout.sampling.max_new_tokens=64",
            "rollout.partial.token_budget=8",
            "rollout.max_staleness=7",
        ],
    )
    assert cfg.rollout.partial.token_budget * (cfg.rollout.max_staleness + 1) == 64


def test_retract_mode_needs_partial_and_no_token_budget():
    with pytest.raises(ConfigError, match=r"rollout.partial.mode='retract': needs enabled=true"):
        load_config(None, ["rollout.partial.mode=retract"])
    with pytest.raises(ConfigError, match=r"rollout.partial.token_budget=16: does not apply with mode=retract"):
        load_config(
            None, ["rollout.partial.enabled=true", "rollout.partial.mode=retract", "rollout.partial.token_budget=16"]
        )
    with pytest.raises(ConfigError, match="rollout.partial.mode"):
        load_config(None, ["rollout.partial.enabled=true", "rollout.partial.mode=pause"])
    assert (
        load_config(None, ["rollout.partial.enabled=true", "rollout.partial.mode=retract"]).rollout.partial.mode
        == "retract"
    )


def test_sglang_args_pass_through_and_never_override_the_launcher(tmp_path):
    cfg = load_config(
        None,
        ["rollout.engines.sglang_args.attention_backend=triton", "rollout.engines.sglang_args.cuda-graph-max-bs=64"],
    )
    assert cfg.rollout.engines.sglang_args == {"attention_backend": "triton", "cuda-graph-max-bs": 64}
    (tmp_path / "job.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "job.yaml") == cfg
    with pytest.raises(
        ConfigError,
        match=r"rollout.engines.sglang_args.tp_size=4: is the launcher's option "
        r"\(set from rollout.engines.tensor_parallel\)",
    ):
        load_config(None, ["rollout.engines.sglang_args={tp_size: 4}"])
    with pytest.raises(ConfigError, match=r"rollout.engines.sglang_args=3: must be a mapping"):
        load_config(None, ["rollout.engines.sglang_args=3"])
    with pytest.raises(ConfigError, match=r"rollout.engines.sglang_args.json-model-override-args=.*: must be a scalar"):
        load_config(None, ["rollout.engines.sglang_args.json-model-override-args={rope_theta: 1}"])


def test_stop_when_rules():
    assert parse_stop_when("sft/answer_acc>=0.2") == ("sft/answer_acc", ">=", 0.2)
    assert parse_stop_when(" loss/sft <= 5e-1 ") == ("loss/sft", "<=", 0.5)
    assert load_config(None, ["stop_when=loss/sft<=0.5", "stop_window=3"]).stop_when == "loss/sft<=0.5"
    for bad in ("loss/sft<0.5", ">=0.2", "acc>=high", "acc>=nan", "acc>=inf"):
        with pytest.raises(ConfigError, match=r'stop_when=.*must be "METRIC>=VALUE" or "METRIC<=VALUE"'):
            load_config(None, [f"stop_when={bad}"])
    with pytest.raises(ConfigError, match="stop_window=0: must be >= 1"):
        load_config(None, ["stop_window=0"])


def test_a_file_that_is_not_yaml_is_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("steps: 5\nrollout: [unclosed\n")
    with pytest.raises(ConfigError, match=r"config=.*job.yaml'?: not valid YAML: .*line 3"):
        load_config(path)


def test_asynchronous_mode_refuses_what_cannot_work_with_it():
    with pytest.raises(ConfigError, match=r"rollout.deterministic=True: needs mode=sync"):
        load_config(None, ["rollout.mode=async", "rollout.deterministic=true"])
    with pytest.raises(ConfigError, match=r"rollout.engines.colocate=True: mode=async generates while the trainer"):
        load_config(None, ["rollout.mode=async", "rollout.engines.colocate=true"])
    with pytest.raises(ConfigError, match=r"rollout.partial.enabled=True: applies to mode=sync"):
        load_config(None, ["rollout.mode=async", "rollout.partial.enabled=true"])
    with pytest.raises(ConfigError, match=r"rollout.pause_mode='pause': must be one of"):
        load_config(None, ["rollout.mode=async", "rollout.pause_mode=pause"])
    cfg = load_config(None, ["rollout.mode=async", "rollout.max_staleness=2", "rollout.pause_mode=abort"]).rollout
    assert (cfg.mode, cfg.max_staleness, cfg.pause_mode, cfg.token_budget) == ("async", 2, "abort", 64)


def test_the_reward_section_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("reward:\n  by: data_source\n  table: {math_dapo: dapo}\n  range: [-1, 1]\n  workers: 4\n")
    cfg = load_config(path, ["reward.table.aime=math", "reward.timeout_s=5", "reward.overlong_buffer=16"])
    r = cfg.reward
    assert r.by == "data_source" and r.table == {"math_dapo": "dapo", "aime": "math"}
    assert (r.range, r.workers, r.timeout_s, r.overlong_buffer, r.function) == ((-1.0, 1.0), 4, 5.0, 16, "math")
    (tmp_path / "resolved.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_the_reward_fields_that_were_under_data_are_refused_naming_their_new_place(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.reward_by: unknown key; moved to reward.by$"):
        load_config(None, ["data.reward_by=data_source"])
    (tmp_path / "old.yaml").write_text("data:\n  path: x.jsonl\n  reward: dapo\n")
    with pytest.raises(ConfigError, match=r"^data.reward: unknown key; moved to reward.function$"):
        load_config(tmp_path / "old.yaml")
    old = [key for key, new in MOVED.items() if new.startswith("reward.") and key not in STILL_READ]
    assert len(old) == 11
    with pytest.raises(ConfigError, match=r"^data.rewards: unknown key; moved to reward.table$"):
        load_config(None, ["data.rewards={a: math}"])
    for key in old:
        with pytest.raises(ConfigError, match=f"moved to {MOVED[key]}"):
            load_config(None, [f"{key}=1"])


def test_reward_routes_is_still_read_as_reward_table(tmp_path):
    """reward.table was reward.routes (a name MoE "routes" also had): every config.yaml a run saved
    before the rename names it, so the old name is read into the new field, with a warning, from a
    file, an override, or both at once; beside the new name it is an error."""
    saved = tmp_path / "config.yaml"
    saved.write_text("reward:\n  by: data_source\n  routes: {math_dapo: dapo}\n")
    with pytest.warns(FutureWarning, match=r"reward.routes is now called reward.table"):
        cfg = load_config(saved, ["reward.routes.aime=math"])
    assert cfg.reward.table == {"math_dapo": "dapo", "aime": "math"}
    with pytest.warns(FutureWarning):
        assert load_config(None, ["reward.by=src", "reward.routes={a: exact}"]).reward.table == {"a": "exact"}
    (tmp_path / "both.yaml").write_text("reward:\n  by: src\n  routes: {a: math}\n  table: {b: math}\n")
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"reward.routes=.*table.s old name, and table"):
        load_config(tmp_path / "both.yaml")
    assert "  table:" in dump_config(cfg) and "  routes:" not in dump_config(cfg)
