"""Bad conversion input is a clear error before any work, and no output appears under its final name."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import make_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import convert_checkpoint as cli


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    make_hf_model(root, "qwen2-gqa2")
    return root / "qwen2-gqa2"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe")
    make_hf_model(root, "qwen3-moe", ("qwen3_moe", 2, False))  # 4 experts in layers 1-3
    return root / "qwen3-moe"


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _fails(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_missing_and_truncated_shards(hf_dir, tmp_path, capsys):
    broken = _copy(hf_dir, tmp_path / "missing")
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "o1")],
        f"shard(s) named in model.safetensors.index.json are missing: {shard.name}",
    )
    truncated = _copy(hf_dir, tmp_path / "truncated")
    shard = sorted(truncated.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(truncated), "--out", str(tmp_path / "o2")],
        f"{shard}: not a readable safetensors file",
    )
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_shapes_that_disagree_with_config(hf_dir, tmp_path, capsys):
    wrong = _copy(hf_dir, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(config))
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(wrong), "--out", str(tmp_path / "o")],
        "model.layers.0.mlp.gate_proj.weight has shape (128, 64), config.json implies (96, 64)",
    )


def test_unmapped_architecture_and_layouts(hf_dir, tmp_path, capsys):
    other = _copy(hf_dir, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(other), "--out", str(tmp_path / "o")],
        "architectures=['GPT2LMHeadModel']: not mapped",
    )
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--tp", "3"],
        "parallel.tensor=3: must divide the 4 attention heads",
    )
    _fails(
        capsys, ["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--pp", "3"], "parallel.pipeline=3"
    )
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--ep", "2"],
        "parallel.expert=2: needs a mixture-of-experts model (this one is dense)",
    )


def test_moe_layout_and_expert_count(moe_dir, tmp_path, capsys):
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(moe_dir), "--out", str(tmp_path / "o"), "--ep", "3"],
        "parallel.expert=3: must divide the 4 experts",
    )
    more = _copy(moe_dir, tmp_path / "eight")
    config = json.loads((more / "config.json").read_text())
    (more / "config.json").write_text(json.dumps({**config, "num_experts": 8, "num_local_experts": 8}))
    _fails(
        capsys,
        ["hf-to-mcore", "--hf", str(more), "--out", str(tmp_path / "o")],
        "tensors missing, e.g. model.layers.1.mlp.experts.4.gate_proj.weight",
    )
    assert not (tmp_path / "o").exists()


def test_existing_or_incomplete_directories(hf_dir, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    _fails(capsys, ["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "taken")], "exists already")
    (tmp_path / "half").mkdir()
    _fails(
        capsys,
        ["mcore-to-hf", "--mcore", str(tmp_path / "half"), "--out", str(tmp_path / "o")],
        "not a complete Megatron dist checkpoint (no metadata.json)",
    )
    _fails(capsys, ["hf-to-mcore", "--hf", str(tmp_path / "half"), "--out", str(tmp_path / "o")], "has no config.json")


def test_reshard_reports_a_full_disk_as_one_error_line(monkeypatch, tmp_path, capsys):
    import errno
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import reshard

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(reshard, "mcore_to_hf", full)
    assert reshard.main(["--mcore", str(tmp_path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: [Errno 28] No space left on device" and "Traceback" not in err


def test_a_checkpoint_carries_its_models_config_and_tokenizer(hf_dir):
    """What a trainer's step directory carries beside the weights: the HF config (model.hf_path's
    config.json as it is, or the built-in model's) and model.hf_path's tokenizer files."""
    from bapo_megatron.common.model_spec import ModelSpec, tiny_spec
    from bapo_megatron.trainer.checkpoint import HF_CONFIG, model_files

    built_in = model_files(tiny_spec(), None)
    assert set(built_in) == {HF_CONFIG}
    assert ModelSpec.from_hf_config(json.loads(built_in[HF_CONFIG])) == tiny_spec()
    files = model_files(ModelSpec.from_hf_dir(hf_dir), str(hf_dir))
    assert files[HF_CONFIG] == (hf_dir / "config.json").read_bytes()
    assert files["tokenizer.json"] == (hf_dir / "tokenizer.json").read_bytes()
    assert not any(name.endswith(".safetensors") for name in files)


def test_the_converters_resolve_a_run_checkpoint_dir_a_step_or_a_converted_dir(tmp_path):
    """weights_dir, the one reader of the --mcore of mcore-to-hf and reshard (and of model.mcore_path):
    a directory with metadata.json as it is; a run's checkpoint.dir, the newest complete step (what a
    resume loads), also when `latest` is missing or stale; a run's directory, its ckpt/; a pointer to
    nothing, refused by name."""
    from bapo_megatron.errors import BadInputError
    from bapo_megatron.trainer.checkpoint import weights_dir

    run = tmp_path / "ckpt"
    for step, complete in ((2, True), (4, True), (6, False)):
        (run / f"step_{step:08d}").mkdir(parents=True)
        if complete:
            (run / f"step_{step:08d}" / "metadata.json").write_text("{}")
    assert weights_dir(run) == run / "step_00000004"  # no `latest` (a save cut short before it)
    (run / "latest").write_text("step_00000002\n")
    assert weights_dir(run) == run / "step_00000004"  # stale: a resume takes the newest too
    assert weights_dir(run / "step_00000002") == run / "step_00000002"
    assert weights_dir(tmp_path / "empty") == tmp_path / "empty"  # for the reader to refuse
    (tmp_path / "config.yaml").write_text("name: x\n")  # tmp_path is now a run directory, run its ckpt/
    assert weights_dir(tmp_path) == run / "step_00000004"
    lost = tmp_path / "lost"
    lost.mkdir()
    (lost / "latest").write_text("step_00000009\n")
    with pytest.raises(BadInputError, match="names step_00000009, which is not a complete checkpoint"):
        weights_dir(lost)
    (lost / "latest").unlink()
    (lost / "latest").symlink_to(run / "latest")
    with pytest.raises(BadInputError, match="is a symbolic link"):
        weights_dir(lost)
