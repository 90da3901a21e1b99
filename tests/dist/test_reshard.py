"""tools/reshard.py: a checkpoint saved by a TP=2 x PP=2 trainer to HF and to SGLang's per-rank layout.

The HF output is bitwise the original model (read one layer at a time from the resharded
dist checkpoint). The SGLang pre-split output is checked rank by rank against shards cut
straight from the original HF tensors, and merged back into them exactly.

A Qwen3-MoE checkpoint converted from HF loads at TP=2 x EP=2 exactly, and that run's checkpoint
(optimizer included) reshards back to HF bitwise from its checkpoint.dir with no template (it carries
its model's config and tokenizer); a MoE checkpoint with another expert count than its config, or a
damaged expert, is named before any output is written.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

NAME = "qwen2-gqa2"  # 4 heads, 2 key/value heads, QKV bias, untied, vocab 250 (padded)


def _resave_at(rank: int, world: int, root: str, tp: int, pp: int) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    root = Path(root)
    spec = ModelSpec.from_hf_dir(root / NAME)
    cfg = load_config(None, [f"parallel.tensor={tp}", f"parallel.pipeline={pp}"])
    trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    trainer.load_weights(root / "mcore")
    save_model(trainer.model, root / "trained")


def _convert(rank: int, world: int, root: str) -> None:
    import convert_checkpoint as cli

    root = Path(root)
    assert cli.main(["hf-to-mcore", "--hf", str(root / NAME), "--out", str(root / "mcore"), "--no-progress"]) == 0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A HF model, and a dist checkpoint of it saved by the trainer at TP=2 x PP=2 (no hf_config.json)."""
    root = tmp_path_factory.mktemp("reshard")
    model = make_hf_model(root, NAME)
    run_workers(_convert, 1, str(root))
    run_workers(_resave_at, 4, str(root), 2, 2)
    return root, model.state_dict()


def _read(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in directory.glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


def test_trainer_checkpoint_to_hf_bitwise(saved, tmp_path):
    import reshard

    root, original = saved
    out = tmp_path / "hf"
    assert (
        reshard.main(
            [
                "--mcore",
                str(root / "trained"),
                "--out",
                str(out),
                "--hf-template",
                str(root / NAME),
                "--dtype",
                "float32",
                "--max-shard-gb",
                "0.0002",
                "--no-progress",
            ]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and (out / "tokenizer.json").is_file()
    tensors = _read(out)
    assert set(tensors) == set(original)
    for name, tensor in original.items():
        assert torch.equal(tensors[name], tensor), name


def _expected_rank(original: dict, rank: int, tp: int, kv_heads: int, head_dim: int, heads: int, vocab: int):
    """Rank `rank`'s tensors for layer 0 and the embedding, cut directly from the HF tensors."""
    from bapo_megatron.weights.sglang_shards import sglang_padded_vocab

    q = original["model.layers.0.self_attn.q_proj.weight"]
    k, v = original["model.layers.0.self_attn.k_proj.weight"], original["model.layers.0.self_attn.v_proj.weight"]
    q_rows = heads // tp * head_dim
    kv_head = (
        [rank * kv_heads // tp] if tp >= kv_heads else list(range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp))
    )
    kv_rows = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in kv_head])
    qkv = torch.cat([q[rank * q_rows : (rank + 1) * q_rows], k[kv_rows], v[kv_rows]])
    per = sglang_padded_vocab(vocab, tp) // tp
    embed = torch.zeros(per, q.shape[1])
    part = original["model.embed_tokens.weight"][rank * per : (rank + 1) * per]
    embed[: part.shape[0]] = part
    return qkv, embed


@pytest.mark.parametrize("tp", [2, 4])
def test_sglang_presplit(saved, tmp_path, tp):
    import reshard
    from safetensors.torch import load_file

    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.weights.sglang_shards import merge_ranks, rank_entries

    root, original = saved
    spec = ModelSpec.from_hf_dir(root / NAME)
    out = tmp_path / "sglang"
    assert (
        reshard.main(
            [
                "--mcore",
                str(root / "trained"),
                "--out",
                str(out),
                "--hf-template",
                str(root / NAME),
                "--dtype",
                "float32",
                "--sglang-tp",
                str(tp),
                "--no-progress",
            ]
        )
        == 0
    )
    ranks = []
    for rank in range(tp):
        files = sorted(out.glob(f"model-rank-{rank}-part-*.safetensors"))
        assert [f.name for f in files] == [f"model-rank-{rank}-part-0.safetensors"]
        tensors = load_file(str(files[0]))
        assert {n: tuple(t.shape) for n, t in tensors.items()} == {
            e.name: e.shape for e in rank_entries(spec, tp, torch.float32)
        }
        qkv, embed = _expected_rank(
            original, rank, tp, spec.num_kv_heads, spec.head_dim, spec.num_heads, spec.vocab_size
        )
        assert torch.equal(tensors["model.layers.0.self_attn.qkv_proj.weight"], qkv)
        assert torch.equal(tensors["model.embed_tokens.weight"], embed)
        ranks.append(tensors)
    merged = merge_ranks(spec, ranks)
    assert set(merged) == set(original)
    for name, tensor in original.items():
        assert torch.equal(merged[name], tensor), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_reshard_bad_input(saved, tmp_path, capsys):
    import reshard

    root, _ = saved
    args = ["--hf-template", str(root / NAME), "--no-progress"]
    assert (
        reshard.main(["--mcore", str(root / "trained"), "--out", str(tmp_path / "a"), "--sglang-tp", "3", *args]) == 2
    )
    assert "SGLang TP 3 must divide the 4 attention heads" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.*.tmp"))
    broken = tmp_path / "broken"
    shutil.copytree(root / "trained", broken)
    (broken / "metadata.json").unlink()
    assert reshard.main(["--mcore", str(broken), "--out", str(tmp_path / "b"), *args]) == 2
    assert "not a complete Megatron dist checkpoint (no metadata.json)" in capsys.readouterr().err
    truncated = tmp_path / "truncated"
    shutil.copytree(root / "trained", truncated)
    data = sorted(truncated.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert reshard.main(["--mcore", str(truncated), "--out", str(tmp_path / "t"), *args]) == 2
    assert f"{data.name} is truncated ({data.stat().st_size} bytes, its metadata needs" in capsys.readouterr().err
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".t.*.tmp"))
    flipped = tmp_path / "flipped"  # same size, one byte changed: only the checksums can tell
    shutil.copytree(root / "trained", flipped)
    data = sorted(flipped.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert reshard.main(["--mcore", str(flipped), "--out", str(tmp_path / "f"), *args]) == 2
    assert f"{data.name} differs from what was written (checksum)" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()
    other = tmp_path / "other"
    shutil.copytree(root / NAME, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (other / "config.json").write_text(json.dumps(config))
    assert (
        reshard.main(
            [
                "--mcore",
                str(root / "trained"),
                "--out",
                str(tmp_path / "c"),
                "--hf-template",
                str(other),
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "num_hidden_layers=6, but the checkpoint's tensors say 4" in err, err
    assert not (tmp_path / "c").exists()
    assert reshard.main(["--mcore", str(root / "trained"), "--out", str(root / NAME), *args]) == 2
    assert "exists already" in capsys.readouterr().err


MOE = "qwen3-moe"  # 4 experts, top-2, layers 1-3 sparse, layer 0 dense


def _convert_moe(rank: int, world: int, root: str) -> None:
    import convert_checkpoint as cli

    hf, out = str(Path(root) / MOE), str(Path(root) / f"{MOE}-mcore")
    assert cli.main(["hf-to-mcore", "--hf", hf, "--out", out, "--ep", "2", "--no-progress"]) == 0


def _run_checkpoint_at_ep2(rank: int, world: int, root: str) -> None:
    """The converted checkpoint loaded by a trainer at TP=2 x EP=2 (the experts split over the two
    ranks) and exported live; one step trained and saved as a run's checkpoint (model, optimizer,
    schedule), and exported again."""
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.gather import hf_buckets_to_rank0
    from tests.helpers import make_batch

    activate_cpu_shim()
    root = Path(root)
    layout = ["parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true"]
    cfg = load_config(
        None,
        [
            *layout,
            "parallel.max_tokens_per_microbatch=48",
            f"checkpoint.dir={root / 'run'}",
            f"model.hf_path={root / MOE}",
        ],
    )
    trainer = PolicyTrainer(ModelSpec.from_hf_dir(root / MOE), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    trainer.load_weights(root / f"{MOE}-mcore")
    for when in ("loaded", "trained"):
        if when == "trained":
            assert not trainer.train_step(make_batch(0, max_len=14)).skipped
            CheckpointManager(cfg.checkpoint).save(trainer)
        exported = {name: t.clone() for bucket in hf_buckets_to_rank0(trainer, 1 << 16) for name, t in bucket}
        if rank == 0:
            torch.save(exported, root / f"{when}.pt")


@pytest.fixture(scope="module")
def moe_saved(tmp_path_factory):
    """A HF Qwen3-MoE model, converted; what a TP=2 x EP=2 trainer exported of it loaded and trained
    one step, and its run checkpoint."""
    from bapo_megatron.common.hf_experts import per_expert

    root = tmp_path_factory.mktemp("reshard-moe")
    model = make_hf_model(root, MOE, ("qwen3_moe", 2, False))
    run_workers(_convert_moe, 1, str(root))
    run_workers(_run_checkpoint_at_ep2, 2, str(root))
    return root, dict(per_expert(model.state_dict()))


def test_moe_converted_loads_at_ep2_and_its_run_checkpoint_reshards_to_hf(moe_saved, tmp_path, capsys):
    """The converted checkpoint, loaded at EP=2, holds the HF model's weights exactly; the run's
    checkpoint (experts saved from two expert-parallel ranks, optimizer keys passed over) comes back
    from its checkpoint.dir as the trained weights, bitwise, one tensor per expert, with the model's
    config and tokenizer and no --hf-template, through reshard and mcore-to-hf alike. A carried file
    that changed, or that links out of the checkpoint, is refused by name."""
    import convert_checkpoint
    import reshard
    from torch.distributed.checkpoint import FileSystemReader

    root, original = moe_saved
    loaded, trained = torch.load(root / "loaded.pt"), torch.load(root / "trained.pt")
    assert set(loaded) == set(original) and all(torch.equal(loaded[k], t) for k, t in original.items())
    assert not all(torch.equal(trained[k], t) for k, t in original.items())
    keys = FileSystemReader(str(root / "run" / "step_00000001")).read_metadata().state_dict_metadata
    assert any("optimizer.state.exp_avg.decoder.layers.1.mlp.experts" in k for k in keys)
    out = tmp_path / "hf"
    assert reshard.main(["--mcore", str(root / "run"), "--out", str(out), "--no-progress"]) == 0
    tensors = _read(out)
    assert set(tensors) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(tensors[name], tensor), name
    hf_config = json.loads((root / MOE / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == {**hf_config, "torch_dtype": "float32"}
    assert (out / "tokenizer.json").read_bytes() == (root / MOE / "tokenizer.json").read_bytes()
    again = tmp_path / "again"
    assert convert_checkpoint.main(["mcore-to-hf", "--mcore", str(root / "run"), "--out", str(again)]) == 0
    assert _read(again).keys() == tensors.keys() and (again / "tokenizer.json").is_file()

    step = shutil.copytree(root / "run" / "step_00000001", tmp_path / "step")
    raw = bytearray((step / "tokenizer.json").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (step / "tokenizer.json").write_bytes(bytes(raw))
    for carried, problem in (
        ("tokenizer.json", "tokenizer.json differs from what was written (checksum)"),
        ("tokenizer.json", "'tokenizer.json' leads outside"),
        ("hf_config.json", "'hf_config.json' leads outside"),
    ):
        if "outside" in problem:
            (step / carried).unlink()
            (step / carried).symlink_to(root / MOE / "config.json")
        assert reshard.main(["--mcore", str(step), "--out", str(tmp_path / "refused"), "--no-progress"]) == 2
        assert problem in capsys.readouterr().err
        assert not (tmp_path / "refused").exists()


def test_moe_bad_input_is_named_before_writing(moe_saved, tmp_path, capsys):
    """An expert count other than the config's, an expert's chunk missing from the metadata, and an
    expert's chunk that is no tensor: each an error naming it, and no output."""
    import pickle

    import reshard
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from bapo_megatron.trainer.safe_load import read_metadata

    root, _ = moe_saved
    experts = "decoder.layers.2.mlp.experts.experts.linear_fc2.weight"

    def fails(step: Path, template: Path, out: str) -> str:
        args = ["--mcore", str(step), "--out", str(tmp_path / out), "--hf-template", str(template), "--no-progress"]
        assert reshard.main(args) == 2
        assert not (tmp_path / out).exists() and not list(tmp_path.glob(f".{out}.*.tmp"))
        return capsys.readouterr().err

    other = shutil.copytree(root / MOE, tmp_path / "eight")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_experts": 8, "num_local_experts": 8}))
    err = fails(root / "run", other, "a")
    assert "num_experts=8, but the checkpoint's hf_config.json says 4" in err  # the run records its model

    def copy(name: str) -> tuple[Path, object]:  # another tool's checkpoint: no checksums to catch the damage
        step = shutil.copytree(root / "run" / "step_00000001", tmp_path / name)
        (step / "checksums.json").unlink()
        return step, read_metadata(step)

    step, metadata = copy("missing")
    chunks = metadata.state_dict_metadata[experts].chunks
    chunks[:] = [c for c in chunks if tuple(c.offsets) != (3, 0, 0)]
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    err = fails(step, root / MOE, "b")
    assert (
        f"decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight is incomplete: the stored chunks of {experts}"
        in err
    )

    step, metadata = copy("zeroed")
    info = metadata.storage_data[MetadataIndex(experts, (3, 0, 0))]
    with open(step / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))
    err = fails(step, root / MOE, "c")
    assert f"chunk of {experts} at (3, 0, 0) in {info.relative_path} is unreadable" in err
