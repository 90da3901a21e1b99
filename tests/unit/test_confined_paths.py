"""Files of a checkpoint or a model directory never lead a reader outside that directory (issue 34).

A dist checkpoint's `.metadata` whose storage names an absolute path, `../` or a symbolic link out,
a `checksums.json` listing such names, and a Hugging Face index whose weight_map names such a shard
are refused, naming the file and the name, before anything there is read: by the trainer's resume
and starting weights, mcore-to-hf, reshard and hf-to-mcore (one `error:` line). A crafted
`common.pt` is refused naming it, with no advice to lower torch.load's safety setting.

The dist checkpoints here are written by torch DCP alone (the keys and shapes a converted one
holds): no process group, no model.
"""

import contextlib
import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from bapo_megatron.common.hf_io import INDEX, HFCheckpoint
from bapo_megatron.errors import BadInputError
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.trainer.safe_load import read_metadata
from bapo_megatron.weights.mcore_io import EMBEDDING, FINAL_NORM, HF_CONFIG, OUTPUT, StoredChunks, layer_shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import convert_checkpoint
import reshard

DATA = "__0_0.distcp"


class Command:
    """A pickle that runs a command when loaded (what a hostile file would carry)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _mcore(directory: Path, common: object = None) -> Path:
    """A Megatron dist checkpoint of tiny_spec with a converted one's keys, stacked layers and hf_config.json."""
    spec = tiny_spec()
    g = torch.Generator().manual_seed(0)
    state = {
        EMBEDDING: torch.randn(256, spec.hidden_size, generator=g),
        FINAL_NORM: torch.randn(spec.hidden_size, generator=g),
        OUTPUT: torch.randn(256, spec.hidden_size, generator=g),
    }
    for suffix, shape in layer_shapes(spec).items():
        state[f"decoder.layers.{suffix}"] = torch.randn(spec.num_layers, *shape, generator=g)
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1)
    dcp.save(state, storage_writer=writer, no_dist=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({} if common is None else common, directory / "common.pt")
    (directory / HF_CONFIG).write_text(json.dumps(spec.to_hf_config()))
    return directory


def _storage_named(directory: Path, name: str) -> None:
    """Rewrite the checkpoint's .metadata so that every stored item lies in the file `name`."""
    metadata = read_metadata(directory)
    for info in metadata.storage_data.values():
        info.relative_path = name
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def _data_outside(directory: Path, how: str) -> str:
    """The checkpoint's data file moved out of it, and the name its .metadata (or a link) now reaches it by."""
    outside = directory.parent / "outside.distcp"
    (directory / DATA).rename(outside)
    if how == "symlink":
        (directory / DATA).symlink_to(outside)
        return DATA
    name = "../outside.distcp" if how == "dotdot" else str(outside)
    _storage_named(directory, name)
    return name


def _one_error_line(run) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert run() == 2
    text = err.getvalue()
    assert text.startswith("error: ") and text.count("\n") == 1 and "Traceback" not in text, text
    assert "weights_only" not in text
    return text


# --- F11: a checkpoint's .metadata and checksums.json -------------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_conversion_refuses_storage_outside_the_checkpoint(tmp_path, how):
    ckpt = _mcore(tmp_path / "ckpt")
    name = _data_outside(ckpt, how)
    runs = {
        "mcore-to-hf": lambda: convert_checkpoint.main(
            ["mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "o1"), "--no-progress"]
        ),
        "reshard": lambda: reshard.main(["--mcore", str(ckpt), "--out", str(tmp_path / "o2"), "--no-progress"]),
    }
    for tool, run in runs.items():
        text = _one_error_line(run)
        assert f"{ckpt / '.metadata'}: {name!r}" in text and "outside" in text, (tool, text)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    # a reader given metadata nobody checked (torch's own) still joins no such name
    with pytest.raises(BadInputError, match="outside"):
        StoredChunks(ckpt, FileSystemReader(str(ckpt)).read_metadata())


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_resume_refuses_storage_outside_the_checkpoint(tmp_path, how):
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.dist_ckpt import load_sharded
    from bapo_megatron.trainer.integrity import verify_integrity

    step = _mcore(tmp_path / "run" / "step_00000001", common={"common": {"step": 1, "world_size": 1}})
    name = _data_outside(step, how)
    refused = rf"{step / '.metadata'}: {name!r} .*outside"
    with pytest.raises(BadInputError, match=refused):
        verify_integrity(step, check_contents=False)  # the job's check before it starts
    with pytest.raises(BadInputError, match=refused):
        CheckpointManager(CheckpointConfig(dir=str(step.parent))).load(None, step)  # the resume
    with pytest.raises(BadInputError, match=refused):
        load_sharded({}, step)


def test_storage_in_a_system_file_reveals_nothing_of_it(tmp_path):
    """The probe's case: a name such as /etc/passwd was reported with the file's size."""
    from bapo_megatron.trainer.integrity import verify_integrity

    ckpt = _mcore(tmp_path / "ckpt")
    _storage_named(ckpt, "/etc/passwd")
    with pytest.raises(BadInputError) as caught:
        verify_integrity(ckpt)
    assert f"{ckpt / '.metadata'}: '/etc/passwd'" in str(caught.value)
    assert "bytes" not in str(caught.value) and str(os.stat("/etc/passwd").st_size) not in str(caught.value)


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.distcp", "sub/../../outside.distcp"])
def test_checksums_naming_files_outside_are_refused(tmp_path, name):
    from bapo_megatron.trainer.integrity import CHECKSUMS, verify_integrity

    ckpt = _mcore(tmp_path / "ckpt")
    (tmp_path / "outside.distcp").write_bytes(b"x" * 7)
    (ckpt / CHECKSUMS).write_text(json.dumps({name: {"crc32": 0, "size": 1}}))
    with pytest.raises(BadInputError) as caught:
        verify_integrity(ckpt)
    message = str(caught.value)
    assert f"{ckpt / CHECKSUMS}: {name!r}" in message and "outside" in message, message
    assert "bytes" not in message, message  # nothing read about the file it names


# --- F10: a crafted common.pt -------------------------------------------------------------------------------------


def test_crafted_common_pt_is_named_without_advice(tmp_path):
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.dist_ckpt import load_sharded

    marker = tmp_path / "marker"
    step = _mcore(tmp_path / "run" / "step_00000001", common={"common": Command(marker)})
    refused = rf"{step / 'common.pt'}: not a checkpoint this trainer wrote"
    with pytest.raises(BadInputError, match=refused) as caught:
        CheckpointManager(CheckpointConfig(dir=str(step.parent))).load(None, step)  # the resume
    assert "weights_only" not in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert "posix.system" in str(caught.value)  # what it met, in our words
    with pytest.raises(BadInputError, match=refused):
        load_sharded({}, step)
    torch.save([1, 2], step / "common.pt")  # plain data, but not a state dict
    with pytest.raises(BadInputError, match=refused):
        load_sharded({}, step)
    assert not marker.exists()


def test_plain_common_pt_still_loads(tmp_path):
    from megatron.core import dist_checkpointing

    from bapo_megatron.trainer import safe_load

    step = _mcore(tmp_path / "step", common={"common": {"step": 3, "scheduler": {"lr": 0.5}, "config": "x: 1"}})
    safe_load.install_safe_loaders()
    assert dist_checkpointing.load_common_state_dict(str(step))["common"]["scheduler"] == {"lr": 0.5}


def test_byte_item_refusal_gives_no_advice():
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from bapo_megatron.trainer.safe_load import _safe_planner_class

    planner = _safe_planner_class()()
    planner.metadata = Metadata(state_dict_metadata={}, storage_data={})
    buffer = io.BytesIO()
    torch.save([Command(Path("/nonexistent/marker"))], buffer)
    buffer.seek(0)
    index = MetadataIndex("payload/shard_0_1")
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
    with pytest.raises(BadInputError, match=r"item 'payload/shard_0_1' is not plain data") as caught:
        planner.load_bytes(item, buffer)
    assert "weights_only" not in str(caught.value) and "posix.system" in str(caught.value), caught.value


# --- F12: a Hugging Face index naming shards outside the model ----------------------------------------------------


def _index_outside(hf_dir: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    """A copy of the model whose first shard lies outside it, named so by the index."""
    model = shutil.copytree(hf_dir, tmp_path / "model")
    index = json.loads((model / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "x.safetensors"
    (model / shard).rename(outside)
    name = "../x.safetensors" if how == "dotdot" else str(outside)
    index["weight_map"] = {k: name if v == shard else v for k, v in index["weight_map"].items()}
    (model / INDEX).write_text(json.dumps(index))
    return model, name


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_hf_to_mcore_refuses_shards_outside_the_model(hf_model, tmp_path, how):
    model, name = _index_outside(hf_model("qwen2-gqa2"), tmp_path, how)
    text = _one_error_line(
        lambda: convert_checkpoint.main(["hf-to-mcore", "--hf", str(model), "--out", str(tmp_path / "o")])
    )
    assert f"{model / INDEX}: {name!r}" in text and "outside" in text, text
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_trainer_refuses_shards_outside_the_model(hf_model, tmp_path, how):
    from types import SimpleNamespace

    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    model, name = _index_outside(hf_model("qwen2-gqa2"), tmp_path, how)
    trainer = SimpleNamespace(  # what load_hf_into_trainer reads of a PolicyTrainer; no chunks to fill
        model=[],
        spec=ModelSpec.from_hf_dir(model),
        vocab_local=256,
        info=SimpleNamespace(tp_size=1),
        optimizer=SimpleNamespace(reload_model_params=lambda: None),
    )
    with pytest.raises(BadInputError, match=rf"{model / INDEX}: {name!r} .*outside"):
        load_hf_into_trainer(trainer, model)


def test_a_shard_linked_out_of_the_model_is_refused(hf_model, tmp_path):
    model = shutil.copytree(hf_model("qwen2-gqa2"), tmp_path / "model")
    shard = sorted(model.glob("model-*.safetensors"))[0]
    shard.rename(tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(BadInputError, match=rf"{model / INDEX}: {shard.name!r} .*outside"):
        HFCheckpoint(model)


def test_a_hugging_face_cache_snapshot_still_loads(hf_model, tmp_path):
    """The hub's cache keeps a snapshot's files as links to ../../blobs: inside the cache entry, allowed."""
    entry = tmp_path / "models--test--tiny"
    snapshot = entry / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (entry / "blobs").mkdir()
    for i, file in enumerate(sorted(hf_model("qwen2-gqa2").iterdir())):
        shutil.copy(file, entry / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert len(HFCheckpoint(snapshot).keys()) > 0
    outside = tmp_path / "other.safetensors"
    shard = sorted(snapshot.glob("model-*.safetensors"))[0]
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)  # a link out of the cache entry: refused all the same
    with pytest.raises(BadInputError, match="outside"):
        HFCheckpoint(snapshot)


# --- the helper ---------------------------------------------------------------------------------------------------


def test_inside_refuses_names_that_leave_the_directory(tmp_path):
    from bapo_megatron.errors import OutsideDirectoryError, inside

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_text("x")
    (root / "in").symlink_to(root / "sub" / "f")
    (tmp_path / "secret").write_text("x")
    (root / "out").symlink_to(tmp_path / "secret")
    (root / "outdir").symlink_to(tmp_path)
    source = root / "index.json"
    assert inside(root, "sub/f", source) == root / "sub" / "f"
    assert inside(root, "in", source) == root / "in"  # a link that stays inside
    assert inside(root, "not-there-yet", source) == root / "not-there-yet"
    for name in ("/etc/passwd", "..", "../secret", "sub/../../secret", "out", "outdir/secret", "", None, 3, "a\0b"):
        with pytest.raises(OutsideDirectoryError) as caught:
            inside(root, name, source)
        assert str(caught.value).startswith(f"{source}: {name!r} "), caught.value
        assert isinstance(caught.value, BadInputError)
