"""Nothing of a received model directory is run: a config.json or tokenizer_config.json whose auto_map
names Python files of the directory (and a model_type transformers does not know, so that it would
take them) is refused by name at every entry point, before transformers sees it; and transformers
is always told not to run such code (trust_remote_code=False), should a path get there anyway.

Each test answers transformers' "Do you wish to run the custom code? [y/N]" with y, as a user at a
terminal might: the directory's module would then touch a flag file on import.
"""

import builtins
import json
import shutil
import sys
from pathlib import Path

import pytest

from bapo_megatron.errors import BadInputError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import convert_checkpoint

EVIL = """import pathlib
pathlib.Path({flag!r}).touch()
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
class EvilConfig(Qwen2Config):
    model_type = "evil_qwen2"
class EvilModel(Qwen2ForCausalLM):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture
def flag(tmp_path, monkeypatch):
    """The file the directory's module touches when imported; a terminal that answers y; transformers'
    module cache under tmp_path (where it would copy the module to import it)."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(builtins, "input", lambda *args: "y")
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    return tmp_path / "code-was-run"


@pytest.fixture
def hostile(hf_model, tmp_path, flag):
    """A valid tiny model whose config.json maps its classes to evil.py (model_type unknown to transformers)."""
    model = shutil.copytree(hf_model("qwen2-gqa2"), tmp_path / "hostile")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "evil_qwen2"
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "evil.py").write_text(EVIL.format(flag=str(flag)))
    return model


def _refused(err: str, file: Path, flag: Path) -> None:
    assert f"{file}: its auto_map names code" in err, err
    assert not flag.exists(), "the directory's code was imported"


def test_the_trainers_loader_refuses_auto_map_and_unknown_model_types(hostile, flag):
    from bapo_megatron.models.spec import ModelSpec, tiny_spec

    with pytest.raises(BadInputError) as refused:
        ModelSpec.from_hf_dir(hostile)  # the run's pre-flight and the trainer's model
    _refused(str(refused.value), hostile / "config.json", flag)
    config = {**tiny_spec().to_hf_config(), "model_type": "evil_qwen2"}
    with pytest.raises(BadInputError, match=r"x.json: model_type 'evil_qwen2' is not 'qwen2'"):
        ModelSpec.from_hf_config(config, "x.json")


def test_hf_to_mcore_refuses_it(hostile, tmp_path, flag, capsys):
    out = tmp_path / "out"
    assert convert_checkpoint.main(["hf-to-mcore", "--hf", str(hostile), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    _refused(err, hostile / "config.json", flag)
    assert not out.exists()


def test_verify_refuses_it(hostile, tmp_path, flag, capsys):
    mcore = tmp_path / "no-checkpoint-needed"  # refused before the checkpoint is looked at
    assert convert_checkpoint.main(["verify", "--hf", str(hostile), "--mcore", str(mcore)]) == 2
    _refused(capsys.readouterr().err, hostile / "config.json", flag)


def test_evaluate_refuses_it(hostile, tmp_path, flag):
    from bapo_megatron.evaluate import evaluate_hf

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": [1, 2, 3], "answer": "t4"}) + "\n")
    with pytest.raises(BadInputError) as refused:
        evaluate_hf(hostile, heldout, samples=1, max_new_tokens=2)
    _refused(str(refused.value), hostile / "config.json", flag)


def test_the_embedded_engine_refuses_it_and_transformers_is_told_not_to_run_it(hostile, flag):
    from bapo_megatron.engines.embedded.cli import _model_dir_problem
    from bapo_megatron.engines.embedded.core import EngineCore

    _refused(_model_dir_problem(hostile), hostile / "config.json", flag)  # the engine's start
    with pytest.raises(ValueError, match="contains custom code"):
        EngineCore(hostile)  # past our check (a library caller): transformers refuses, asks nothing
    assert not flag.exists()


@pytest.mark.parametrize("with_tokenizer_json", [False, True])
def test_the_tokenizer_load_refuses_it(hf_model, tmp_path, flag, with_tokenizer_json):
    from bapo_megatron.data.prompts import load_tokenizer

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    if with_tokenizer_json:
        shutil.copy(hf_model("qwen2-gqa2") / "tokenizer.json", directory)
    settings = {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "eos_token": "t0"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "evil.py").write_text(EVIL.format(flag=str(flag)))
    with pytest.raises(BadInputError) as refused:
        load_tokenizer(directory)
    _refused(str(refused.value), directory / "tokenizer_config.json", flag)


def test_a_models_tokenizer_config_is_checked_with_it(hf_model, tmp_path, flag):
    """The engines and evaluate load the model directory's tokenizer too: its auto_map is refused with
    the model (HFCheckpoint), before any work."""
    from bapo_megatron.common.hf_io import HFCheckpoint

    model = shutil.copytree(hf_model("qwen2-gqa2"), tmp_path / "model")
    (model / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.T", None]}}))
    with pytest.raises(BadInputError) as refused:
        HFCheckpoint(model)
    _refused(str(refused.value), model / "tokenizer_config.json", flag)
