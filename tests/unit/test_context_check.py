"""A prompt and its response must fit the model's context (max_position_embeddings): preflight's
check_context refuses more in one line naming the fields and both figures, for the run and the dry
run alike (preflight.validate); every preset is within its model's context."""

from pathlib import Path

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.preflight import check_context, model_spec

ROOT = Path(__file__).resolve().parents[2]
MOONLIGHT = "examples/moonlight-16b-a3b/config.yaml"
TOO_LONG = ["rollout.sampling.max_new_tokens=8192", "parallel.max_tokens_per_microbatch=9216"]


def test_moonlight_with_8k_responses_after_1k_prompts_is_refused_by_the_run_and_the_dry_run(capsys, monkeypatch):
    """Moonlight's context is 8,192 positions: 1,024 + 8,192 = 9,216 tokens do not fit."""
    from bapo_megatron.plan import plan_run
    from bapo_megatron.train import main

    with pytest.raises(ConfigError) as refused:  # the run's plan: fitted to 80 GiB GPUs, then validate()
        plan_run(load_config(ROOT / MOONLIGHT, TOO_LONG), 8, 80 << 30, machine=False)
    message = str(refused.value)
    for part in ("rollout.sampling.max_new_tokens=8192", "data.max_prompt_tokens=1024", "9,216", "8,192"):
        assert part in message, message
    assert "max_position_embeddings" in message and "moonlight-16b-a3b/shape/config.json" in message
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:
        main([MOONLIGHT, *TOO_LONG, "--dry-run", "--world-size=8"])
    assert exited.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_without_a_prompt_cap_responses_must_leave_room_for_a_prompt():
    cfg = load_config(None, ["rollout.sampling.max_new_tokens=4096", "parallel.max_tokens_per_microbatch=8192"])
    assert cfg.data.max_prompt_tokens is None and model_spec(cfg).max_position_embeddings == 4096
    with pytest.raises(ConfigError, match=r"leaves no room for a prompt in the model's context"):
        check_context(cfg, model_spec(cfg))
    check_context(load_config(None, ["rollout.sampling.max_new_tokens=4095"]), model_spec(cfg))


@pytest.mark.parametrize(
    "file", sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("examples/*/*.yaml") if "demo" not in p.parts)
)
def test_every_preset_fits_its_models_context(file):
    cfg = load_config(ROOT / file)
    spec = model_spec(cfg)
    check_context(cfg, spec)
    assert cfg.rollout.sampling.max_new_tokens + (cfg.data.max_prompt_tokens or 1) <= spec.max_position_embeddings
