"""The live export reads each layer's spec (TE's fused norms or the local ones) from its
parameter names, so exporting a TE-built model needs no flag (it used to default to "local",
which fails on a TE model's names)."""

import pytest
import torch
import transformers

from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.weights.layout import hf_to_megatron, layer_impl, megatron_layer_to_hf


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_each_layers_spec_is_read_from_its_names(impl):
    spec = tiny_spec()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**spec.to_hf_config()))
    hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    mg = hf_to_megatron(spec, hf_state, 256, impl)
    for i in range(spec.num_layers):
        layer = {k: v for k, v in mg.items() if k.startswith(f"decoder.layers.{i}.")}
        assert layer_impl(layer) == impl
        back = dict(megatron_layer_to_hf(spec, i, layer, layer_impl(layer)))
        assert back and all(torch.equal(t, hf_state[n]) for n, t in back.items())
    other = "local" if impl == "transformer_engine" else "transformer_engine"
    with pytest.raises(KeyError):  # what the fixed default did to the other spec's layers
        dict(megatron_layer_to_hf(spec, 0, {k: v for k, v in mg.items() if ".0." in k}, other))
    with pytest.raises(ValueError, match="neither spec"):
        layer_impl([n for n in mg if "norm" not in n])
