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
    from bapo_megatron.models.spec import ModelSpec, tiny_spec
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


def test_parallel_sizes_below_one_are_refused(hf_dir, tmp_path, capsys):
    """--ep 0 was a ZeroDivisionError traceback; a size below 1 is one argparse error naming the flag,
    and hf_to_mcore's own check names the layout field."""
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.weights.convert import hf_to_mcore

    for flag in ("--tp", "--pp", "--ep"):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), flag, "0"])
        assert stopped.value.code == 2
        assert f"argument {flag}: 0: must be at least 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"parallel.expert=0: must be >= 1"):
        hf_to_mcore(hf_dir, tmp_path / "o", ep=0)
    assert not (tmp_path / "o").exists()


# --- mcore-to-hf: the model's shape is the checkpoint's (its tensors, its hf_config.json, its run.json) --------------

ROWS = 1024  # the converter's padded vocabulary for vocab_size 250 (128 x lcm(tp, vocab_pad_tp 8))


def _mcore(directory: Path, spec, files: dict[str, str] | None = None) -> Path:
    """A Megatron dist checkpoint of `spec` as torch DCP alone writes it (a converted one's keys: a dense
    model's layers stacked, a MoE model's each under its own), with `files` beside it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from bapo_megatron.weights.mcore_io import EMBEDDING, FINAL_NORM, OUTPUT, layer_shapes

    g = torch.Generator().manual_seed(0)
    state = {EMBEDDING: torch.randn(ROWS, spec.hidden_size, generator=g), FINAL_NORM: torch.ones(spec.hidden_size)}
    if not spec.tie_embeddings:
        state[OUTPUT] = torch.randn(ROWS, spec.hidden_size, generator=g)
    for i in range(spec.num_layers):
        for suffix, shape in layer_shapes(spec, i).items():
            if spec.moe is not None:
                state[f"decoder.layers.{i}.{suffix}"] = torch.randn(*shape, generator=g)
            elif i == 0:
                state[f"decoder.layers.{suffix}"] = torch.randn(spec.num_layers, *shape, generator=g)
    dcp.save(state, storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True), no_dist=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({}, directory / "common.pt")
    for name, text in (files or {}).items():
        (directory / name).write_text(text)
    return directory


def _template(directory: Path, config: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _carrying(spec) -> dict[str, str]:
    from bapo_megatron.trainer.checkpoint import HF_CONFIG

    return {HF_CONFIG: json.dumps(spec.to_hf_config())}


def _export(capsys, mcore: Path, out: Path, *template: str) -> str:
    code = cli.main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(out), "--no-progress", *template])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    assert not out.exists()
    return err


@pytest.mark.parametrize("vocab", [10, 249, 251, 1000, 1024])
def test_a_template_with_another_vocabulary_is_refused(vocab, tmp_path, capsys):
    """The embedding's 1024 rows hold any vocabulary up to 1024 (the padding); the checkpoint's own
    config says 250: a template's other count would cut or pad the export (it did, with exit 0)."""
    from bapo_megatron.models.spec import tiny_spec

    spec = tiny_spec()
    mcore = _mcore(tmp_path / "mcore", spec, _carrying(spec))
    template = _template(tmp_path / "template", {**spec.to_hf_config(), "vocab_size": vocab})
    err = _export(capsys, mcore, tmp_path / "out", "--hf-template", str(template))
    assert f"{template / 'config.json'}: vocab_size={vocab}, but the checkpoint's hf_config.json says 250" in err


def test_a_carried_config_that_disagrees_with_the_run_record_is_refused(tmp_path, capsys):
    """A trainer's step directory records its model twice (hf_config.json, run.json): the export
    trusts neither alone."""
    import dataclasses

    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.runinfo import identity
    from bapo_megatron.trainer.checkpoint import RUN_RECORD

    spec = tiny_spec("qwen3_moe")
    record = {RUN_RECORD: json.dumps(identity(load_config(None, []), spec))}  # as the trainer writes it
    agreeing = _mcore(tmp_path / "agreeing", spec, {**_carrying(spec), **record})
    assert cli.main(["mcore-to-hf", "--mcore", str(agreeing), "--out", str(tmp_path / "hf"), "--no-progress"]) == 0
    carried = _carrying(dataclasses.replace(spec, vocab_size=249))
    mcore = _mcore(tmp_path / "mcore", spec, {**carried, **record})
    err = _export(capsys, mcore, tmp_path / "out")
    assert f"{mcore / 'hf_config.json'}: vocab_size=249, but the checkpoint's run.json says 250" in err


def test_a_template_routing_another_top_k_is_refused(tmp_path, capsys):
    """Top-k shows in no tensor: the checkpoint's config (top-2) is the model's; a top-3 template is refused."""
    from bapo_megatron.models.spec import tiny_spec

    spec = tiny_spec("qwen3_moe")
    mcore = _mcore(tmp_path / "mcore", spec, _carrying(spec))
    template = _template(tmp_path / "template", {**spec.to_hf_config(), "num_experts_per_tok": 3})
    err = _export(capsys, mcore, tmp_path / "out", "--hf-template", str(template))
    assert "num_experts_per_tok=3, but the checkpoint's hf_config.json says 2" in err


@pytest.mark.parametrize(
    ("field", "value", "stored"),
    [("num_hidden_layers", 3, 4), ("tie_word_embeddings", True, False), ("vocab_size", 1025, None)],
)
def test_a_template_the_tensors_contradict_is_refused(field, value, stored, tmp_path, capsys):
    """A checkpoint carrying no config (saved before checkpoints did) has its tensors to check a
    template against: a MoE model's layers (each under its own keys: fewer in the config dropped the
    rest), a separate output layer (a tied config dropped it), the embedding's rows."""
    from bapo_megatron.models.spec import tiny_spec

    spec = tiny_spec("qwen3_moe")
    config = {**spec.to_hf_config(), field: value}
    if field == "num_hidden_layers":
        config["mlp_only_layers"] = [0]
    mcore = _mcore(tmp_path / "mcore", spec)
    template = _template(tmp_path / "template", config)
    err = _export(capsys, mcore, tmp_path / "out", "--hf-template", str(template))
    said = f"tensors say {stored!r}" if stored is not None else f"embedding holds {ROWS} rows"
    assert f"{template / 'config.json'}: {field}={value!r}, but the checkpoint's {said}" in err, err


def test_an_export_leaves_auto_map_out_and_refuses_an_unknown_model_type(tmp_path, capsys):
    """A checkpoint carrying a config (or tokenizer_config.json) with auto_map exports without it, so
    that the export loads with transformers' own classes and nothing of the checkpoint is run; one whose
    model_type transformers would not build the model for is refused by name."""
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.checkpoint import HF_CONFIG

    spec = tiny_spec()
    remote = {"auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}}
    files = {
        HF_CONFIG: json.dumps({**spec.to_hf_config(), **remote}),
        "tokenizer_config.json": json.dumps({"eos_token": "t0", "auto_map": {"AutoTokenizer": ["evil.T", None]}}),
        "evil.py": "raise SystemExit('imported')\n",
    }
    mcore = _mcore(tmp_path / "mcore", spec, files)
    with pytest.warns(UserWarning, match="auto_map is left out of the export"):
        assert cli.main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    out = tmp_path / "out"
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"eos_token": "t0"}
    assert not (out / "evil.py").exists()
    unknown = _mcore(tmp_path / "unknown", spec, {HF_CONFIG: json.dumps({**spec.to_hf_config(), "model_type": "evil"})})
    err = _export(capsys, unknown, tmp_path / "out2")
    assert f"{unknown / HF_CONFIG}: model_type 'evil' is not 'qwen2'" in err


def test_a_template_with_another_expert_count_is_refused_by_the_tensors(tmp_path, capsys):
    """With no record of the model in the checkpoint, the experts' stored count names the field."""
    from bapo_megatron.models.spec import tiny_spec

    spec = tiny_spec("qwen3_moe")
    mcore = _mcore(tmp_path / "mcore", spec)
    template = _template(tmp_path / "template", {**spec.to_hf_config(), "num_experts": 8})
    err = _export(capsys, mcore, tmp_path / "out", "--hf-template", str(template))
    assert "mlp.experts.experts.linear_fc1.weight holds 4 experts, the model's config says num_experts=8" in err


def test_a_carried_record_that_cannot_be_read_is_named_when_a_template_is_given(tmp_path, capsys):
    """A template does not stand in for the checkpoint's unreadable record (it is what the template
    is checked against): the error says so, rather than naming the carried file alone."""
    from bapo_megatron.models.spec import tiny_spec

    spec = tiny_spec()
    carried = {"hf_config.json": json.dumps({**spec.to_hf_config(), "model_type": "evil", "auto_map": {}})}
    mcore = _mcore(tmp_path / "mcore", spec, carried)
    template = _template(tmp_path / "template", spec.to_hf_config())
    err = _export(capsys, mcore, tmp_path / "out", "--hf-template", str(template))
    assert "hf_config.json" in err and "which --hf-template is checked against" in err
