"""`python -m bapo_megatron.train` from replayed batches: a resumed run equals an uninterrupted one,
says where it resumed from, and, run again at its last step, says that there is nothing to do; another
run's checkpoint is refused."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch


def _args(root: Path, run: str, steps: int, ckpt: str) -> list[str]:
    return [
        f"rollout.replay={root / 'replay'}",
        f"steps={steps}",
        f"run_dir={root / 'runs' / run}",
        f"checkpoint.dir={root / ckpt}",
        "checkpoint.interval=2",
        "checkpoint.keep_last=1",
        "logging.backends=[jsonl]",
        f"logging.jsonl_path={root / (run + '.jsonl')}",
        "optimizer.lr=1e-3",
        "parallel.max_tokens_per_microbatch=64",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "algo.updates_per_batch=2",
        "algo.bapo.target_rho=0.45",
    ]


def _train_saying(rank: int, world: int, runs: list[list[str]], out: str) -> None:
    """main() on each argument list in turn (one process: no start-up each); what each printed, its
    exit code and its checkpoint's `latest` after it, to `out` (json); then _final_weights_equal."""
    from bapo_megatron.train import main

    said = []
    for args in runs:
        stdout, stderr, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main(args)
            except SystemExit as done:
                code = done.code
        named = Path(next(a for a in args if a.startswith("checkpoint.dir=")).split("=", 1)[1]) / "latest"
        latest = named.read_text() if named.is_file() else None
        said.append({"code": code, "out": stdout.getvalue(), "err": stderr.getvalue(), "latest": latest})
    Path(out).write_text(json.dumps(said))
    _final_weights_equal(Path(out).parent)


def _final_weights_equal(root: Path) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    cfg = load_config(None, _args(Path(root), "x", 4, "full"))
    trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    states = []
    for ckpt in ("full", "resumed"):
        manager = CheckpointManager(cfg.checkpoint.__class__(dir=str(Path(root) / ckpt)))
        assert manager.load(trainer) == 4  # driver steps (8 optimizer steps at 2 updates each)
        assert trainer.step == 8
        states.append(
            {k: v.clone() for k, v in trainer.model[0].module.state_dict().items() if isinstance(v, torch.Tensor)}
        )
    for key, tensor in states[0].items():
        assert torch.equal(tensor, states[1][key]), key


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted(tmp_path):
    (tmp_path / "replay").mkdir()
    for i in range(3):
        make_batch(i).save(tmp_path / "replay" / f"step_{i:03d}.safetensors")
    runs = [
        _args(tmp_path, "full", 4, "full"),
        _args(tmp_path, "resumed", 2, "resumed"),  # stops after 2 of 4 steps
        _args(tmp_path, "resumed", 4, "resumed"),  # resumes at step 2 (4 updates)
        _args(tmp_path, "resumed", 4, "resumed"),  # at its last step: nothing to do
        [*_args(tmp_path, "other", 4, "full"), "name=other"],  # another run's checkpoint
    ]
    run_workers(_train_saying, 1, runs, str(tmp_path / "said.json"))  # and the final weights compared
    uninterrupted, stopped, resumed, finished, foreign = json.loads((tmp_path / "said.json").read_text())
    assert uninterrupted["code"] == stopped["code"] == 0, uninterrupted["err"][-2000:] + stopped["err"][-2000:]
    assert (stopped["latest"] or "").strip() == "step_00000002"  # named by driver step
    assert resumed["code"] == 0, resumed["err"][-2000:]
    assert f"resumed from {tmp_path / 'resumed' / 'step_00000002'}, step 2 of 4" in resumed["out"]
    assert f"checkpoint {tmp_path / 'resumed' / 'step_00000004'}" in resumed["out"]  # the end line, then what next
    assert f"--mcore {tmp_path / 'resumed'} --out {tmp_path / 'runs' / 'resumed' / 'hf'}" in resumed["out"]
    assert finished["code"] == 0 and finished["out"].startswith("already finished at step 4: nothing to do")
    assert foreign["code"] == 2 and "holds step 4 of another run (run name 'bapo', this run 'other')" in foreign["err"]
    assert json.loads((tmp_path / "full" / "step_00000004" / "run.json").read_text())["name"] == "bapo"
    full = [json.loads(line) for line in (tmp_path / "full.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in full] == [r["step"] for r in resumed] == [1, 2, 3, 4]  # a line a batch
    assert [r["train/step"] for r in full] == [r["train/step"] for r in resumed] == [2, 4, 6, 8]  # two updates each
    for a, b in zip(full, resumed, strict=True):
        for key in ("loss/pg", "train/grad_norm", "bapo/clip_low", "bapo/clip_high", "bapo/rho", "train/lr"):
            assert a[key] == b[key], (a["step"], key)
    assert all("rollout_corr/train_rollout_logprob_abs_diff" in r for r in full)  # (of each batch's first update)
    # keep_last=1: only the newest checkpoint stays, and latest names it.
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["latest", "step_00000004"]
