"""Our PEFT adapter export (weights/peft_export.py) read by SGLang 0.5.23's own LoRA loader, from its wheel.

SGLang cannot run on this CPU machine, but its adapter reading does: LoRAConfig parses
adapter_config.json, LoRAAdapter's constructor checks it and initialize_weights_from_tensors files each
tensor under its layer and normalises the names (q/k/v stacked into qkv_proj, gate/up into
gate_up_proj). What then decides whether the server serves it is the memory pool's load: every
weight's name must match one of the adapter's normalised target modules (strict loading, else it is
skipped with a warning), and each must have its buffer's shape, [r x stacked, in] for A and [out, r]
for B (at TP 1, max rank r), from get_default_hidden_dim and get_stacked_multiply: those checks are
restated here around SGLang's own functions (the pool itself needs a GPU). A name or config key of
ours that SGLang does not read is caught: the broken copies below show it.
"""

import ast
import json
import shutil
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.sglang_wheel import load_defs, source

CASE = ("qwen2", 2, False)
LORA = ("model.lora.rank=4", "model.lora.alpha=8")


def _export_worker(rank: int, world: int, hf_dir: str, out: str) -> None:
    """A LoRA trainer's checkpoint, its adapters made nonzero, exported as a PEFT directory out/peft."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import dump_config, load_config
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.models.lora import is_adapter
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.peft_export import write_peft_adapter

    activate_cpu_shim()
    cfg = load_config(None, [f"model.hf_path={hf_dir}", *LORA])
    trainer = PolicyTrainer(HFCheckpoint(hf_dir).spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model[0].module.named_parameters():
            if is_adapter(name):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    CheckpointManager(CheckpointConfig(dir=f"{out}/ckpt"), dump_config(cfg)).save(trainer)
    write_peft_adapter(f"{out}/ckpt", f"{out}/peft")


@pytest.fixture(scope="module")
def exported(hf_model, tmp_path_factory) -> tuple[Path, Path]:
    """(our PEFT directory, its HF base)."""
    hf_dir, out = hf_model("peft-sglang", CASE), tmp_path_factory.mktemp("peft-sglang")
    run_workers(_export_worker, 1, str(hf_dir), str(out))
    return out / "peft", hf_dir


def _constants(wheel: zipfile.ZipFile, path: str, names: tuple[str, ...], namespace: dict) -> dict:
    """Module-level constants of sglang/srt/<path>, evaluated from its source."""
    tree = ast.parse(source(wheel, path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            namespace[node.targets[0].id] = eval(compile(ast.Expression(node.value), path, "eval"), namespace)
    return namespace


def _sglang(wheel: zipfile.ZipFile, monkeypatch) -> dict:
    import logging
    import os
    import re
    from collections.abc import Iterable

    def no_download(*args, **kwargs):
        raise AssertionError("SGLang would download the adapter: our directory was not found")

    ns = {"json": json, "os": os, "re": re, "torch": torch, "nn": torch.nn, "logger": logging.getLogger("sglang")}
    ns |= {"snapshot_download": no_download, "Dict": dict, "Set": set, "Iterable": Iterable}
    ns |= {"LoRAConfig": None, "AutoConfig": None, "LoadConfig": None, "BaseLoRABackend": None}
    ns = _constants(wheel, "lora/lora.py", ("_ROUTED_EXPERT_PATTERN",), ns)
    ns = _constants(wheel, "lora/utils.py", ("DSA_INDEXER_LORA_NAMES", "_KNOWN_LORA_TARGET_MODULES"), ns)
    utils = [
        "get_normalized_target_modules",
        "get_stacked_multiply",
        "get_target_module_name",
        "get_default_hidden_dim",
    ]
    wanted = {
        "lora/lora_config.py": ["LoRAConfig"],
        "lora/lora.py": ["LoRALayer", "LoRAAdapter"],
        "lora/utils.py": utils,
        "layers/utils/common.py": ["get_layer_id"],
    }
    ns = load_defs(wheel, wanted, ns)
    module = types.ModuleType("sglang.srt.lora.utils")  # what _process_weight imports inside itself
    module.get_normalized_target_modules = ns["get_normalized_target_modules"]
    for name in ("sglang", "sglang.srt", "sglang.srt.lora"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.lora.utils", module)
    return ns


def sglang_loads(ns: dict, peft_dir: Path, hf_dir: Path) -> dict[str, set[str]]:
    """What SGLang serves of the adapter at `peft_dir` on the base `hf_dir` (TP 1): {layer's normalised
    module: matrices}, every target module of every layer with its A and B; AssertionError, KeyError or
    ValueError where it would refuse or skip a part (a tensor it files under no layer is dropped)."""
    import transformers
    from safetensors.torch import load_file

    config = ns["LoRAConfig"](str(peft_dir))
    base = transformers.AutoConfig.from_pretrained(str(hf_dir))
    adapter = ns["LoRAAdapter"]("ours", config, base, None, None)
    adapter.initialize_weights_from_tensors(load_file(str(peft_dir / "adapter_model.safetensors")))
    assert not adapter.embedding_layers and not adapter.added_tokens_embeddings
    targets = ns["get_normalized_target_modules"](config.target_modules)
    assert targets <= ns["_KNOWN_LORA_TARGET_MODULES"], targets
    served = {}
    for i, layer in enumerate(adapter.layers):
        for name, weight in layer.weights.items():
            module = ns["get_target_module_name"](name, targets)  # ValueError: skipped (refused when strict)
            inputs, outputs = ns["get_default_hidden_dim"](module, base, i)
            stacked = ns["get_stacked_multiply"](module)
            expected = (config.r * stacked, inputs) if "lora_A" in name else (outputs, config.r)
            assert tuple(weight.shape) == expected, f"{name}: {tuple(weight.shape)}, SGLang's buffer {expected}"
            served.setdefault(f"{i}.{module}", set()).add("A" if "lora_A" in name else "B")
    assert served == {f"{i}.{m}": {"A", "B"} for i in range(len(adapter.layers)) for m in targets}, sorted(served)
    return served


def test_sglang_loads_our_peft_export(wheel, exported, monkeypatch):
    peft_dir, hf_dir = exported
    ns = _sglang(wheel, monkeypatch)
    served = sglang_loads(ns, peft_dir, hf_dir)
    layers = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    modules = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # all-linear, as SGLang stacks it
    assert served.keys() == {f"{i}.{m}" for i in range(layers) for m in modules}
    config = ns["LoRAConfig"](str(peft_dir))
    assert config.lora_alpha / config.r == 2.0 and not config.use_dora


def _broken(peft_dir: Path, out: Path, how: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(peft_dir, out)
    config = json.loads((out / "adapter_config.json").read_text())
    tensors = load_file(str(out / "adapter_model.safetensors"))
    if how == "config key":
        config["alpha"] = config.pop("lora_alpha")
    elif how == "module name":
        tensors = {k.replace("o_proj", "out_projection"): v for k, v in tensors.items()}
    elif how == "layer name":
        tensors = {k.replace(".layers.", ".blocks."): v for k, v in tensors.items()}
    elif how == "matrix layout":
        tensors = {k: v.t().contiguous() if "down_proj.lora_A" in k else v for k, v in tensors.items()}
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize("how", ["config key", "module name", "layer name", "matrix layout"])
def test_a_wrong_name_or_shape_fails_sglangs_checks(wheel, exported, monkeypatch, tmp_path, how):
    peft_dir, hf_dir = exported
    ns = _sglang(wheel, monkeypatch)
    with pytest.raises((AssertionError, KeyError, ValueError, IndexError)):
        sglang_loads(ns, _broken(peft_dir, tmp_path / "broken", how), hf_dir)
