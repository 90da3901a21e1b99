"""A checkpoint converted without Transformer Engine loads into a model with TE's key set.

TE modules carry `_extra_state` (fp8 scaling history) in their state dicts, the final norm
included; a checkpoint written by the converters (local spec) has none. Here the local-spec
model is given TE's key set (every module TE would replace reports an extra state, so Megatron's
own sharded_state_dict asks for `decoder.final_layernorm._extra_state` and the layers' linears'
ones); loading the converted checkpoint must fill every weight, leave the extra states as the
model made them where the checkpoint has none, and still refuse a checkpoint that lacks a
real weight. (Without the fix Megatron's load fails: "Missing key in checkpoint state_dict:
decoder.final_layernorm._extra_state/shard_0_1".)
"""

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_hf_model

TE_MODULES = ("final_layernorm", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _give_te_keys(model: torch.nn.Module) -> list[str]:
    """Each module TE would replace reports an extra state, as TE's do; returns their names."""
    names = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TE_MODULES:
            base = type(module)
            module.__class__ = type(
                f"TE{base.__name__}",
                (base,),
                {
                    "get_extra_state": lambda self: torch.tensor([7.0]),
                    "set_extra_state": lambda self, state: setattr(self, "extra_state_set", True),
                },
            )
            names.append(f"{name}._extra_state")
    return names


def _load(rank: int, world: int, root: str) -> None:
    from pathlib import Path

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.trainer.dist_ckpt import load_model, model_sharded_state_dict
    from bapo_megatron.weights.convert import _megatron_world_of_one, _model, hf_to_mcore

    root = Path(root)
    hf_to_mcore(root / "hf", root / "mcore", progress=False)
    _megatron_world_of_one()
    spec = HFCheckpoint(root / "hf").spec
    plain, te = _model(spec), _model(spec)
    extra = _give_te_keys(te)
    assert "decoder.final_layernorm._extra_state" in extra
    assert "decoder.final_layernorm._extra_state" in model_sharded_state_dict([te])["chunk0"]  # TE's key set
    load_model([plain], root / "mcore")
    load_model([te], root / "mcore")
    want = {k: v for k, v in plain.state_dict().items() if not k.endswith("_extra_state")}
    got = te.state_dict()
    assert want
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    # the converted checkpoint has the linears' (empty) extra states, as Megatron's linears write
    # them, but none for the norm: TE's final norm keeps the state it was built with
    assert not hasattr(te.decoder.final_layernorm, "extra_state_set")
    # a real weight missing from the checkpoint is still an error, naming it
    te.decoder.final_layernorm.register_parameter("bias", torch.nn.Parameter(torch.zeros(spec.hidden_size)))
    with pytest.raises(ValueError, match=r"lacks 1 tensors this model needs, e.g. \['decoder.final_layernorm.bias'\]"):
        load_model([te], root / "mcore")


@pytest.mark.dist
def test_a_checkpoint_converted_without_te_loads_with_tes_key_set(tmp_path):
    make_hf_model(tmp_path, "hf", ("qwen2", 2, False))
    run_workers(_load, 1, str(tmp_path))
