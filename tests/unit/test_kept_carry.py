"""The kept tensors' file where it is read and written: every tensor the family keeps for the config must
be there (the carried file a resume or a conversion reads, and the HF checkpoint it came from), its size
is what a save budgets, and a link that cannot be made falls back to a copy. The saves themselves (two
ranks) are tests/dist/test_kept_carry.py's."""

import errno
import json
import os

import pytest
from safetensors.torch import save_file

from bapo_megatron.common.hf_io import KEPT_FILE, HFCheckpoint, open_kept_file
from bapo_megatron.models import FAMILIES
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.checkpoint import CarriedFile, model_files
from bapo_megatron.trainer.integrity import file_checksum
from tests import toy_layouts as toys


@pytest.fixture(autouse=True)
def toy_families(monkeypatch):
    for family in (toys.ToyMtp(), toys.ToyVL()):
        monkeypatch.setitem(FAMILIES, family.name, family)


@pytest.fixture
def mtp(tmp_path):
    """A ToyMtp checkpoint with two MTP layers (model.layers.4.*, model.layers.5.*), its spec and config."""
    tensors = toys.mtp_checkpoint(tmp_path / "mtp", mtp_layers=2)
    config = json.loads((tmp_path / "mtp" / "config.json").read_text())
    return tmp_path / "mtp", tensors, ModelSpec.from_hf_dir(tmp_path / "mtp"), config


def test_a_carried_file_missing_a_kept_layer_is_refused_naming_it(mtp, tmp_path):
    _, tensors, spec, config = mtp
    carried = tmp_path / KEPT_FILE
    save_file({n: t for n, t in tensors.items() if n.startswith("model.layers.4.")}, str(carried))
    with pytest.raises(ValueError, match=rf"{KEPT_FILE}: holds no model\.layers\.5\.\* tensor, which the toy_mtp"):
        open_kept_file(carried, spec, config)
    assert len(open_kept_file(carried, spec, {**config, "num_nextn_predict_layers": 1})) == len(toys.MTP_TENSORS)


def test_a_checkpoint_missing_a_layer_its_config_counts_is_refused_naming_it(mtp):
    directory, _, _, config = mtp
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 3}))
    with pytest.raises(ValueError, match=rf"{directory}: holds no model\.layers\.6\.\* tensor"):
        HFCheckpoint(directory)


def test_the_budgeted_size_covers_the_written_file(mtp, tmp_path):
    directory, _, spec, _ = mtp
    carried = model_files(spec, str(directory))[KEPT_FILE]
    assert isinstance(carried, CarriedFile)
    assert carried(tmp_path / KEPT_FILE) is None  # streamed: its checksum is the save's to take
    written = (tmp_path / KEPT_FILE).stat().st_size
    assert written <= carried.nbytes <= 1.5 * written


def test_a_copy_is_linked_or_copied_where_no_link_can_be_made(mtp, tmp_path, monkeypatch):
    directory, _, spec, _ = mtp
    carried = model_files(spec, str(directory))[KEPT_FILE]
    carried(tmp_path / "first")
    carried.checksum, carried.reuse = file_checksum(tmp_path / "first"), tmp_path / "first"
    assert carried(tmp_path / "linked") == carried.checksum
    assert os.stat(tmp_path / "linked").st_ino == os.stat(tmp_path / "first").st_ino

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    assert carried(tmp_path / "copied") == carried.checksum == file_checksum(tmp_path / "copied")
    assert os.stat(tmp_path / "copied").st_ino != os.stat(tmp_path / "first").st_ino
