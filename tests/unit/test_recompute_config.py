"""parallel.recompute: what cannot work is refused before anything starts, naming the field."""

import pytest

from bapo_megatron.common.model_spec import tiny_spec
from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.preflight import validate
from bapo_megatron.trainer.megatron_config import recompute_settings


def test_recompute_settings_and_refusals():
    spec = tiny_spec()
    full = load_config(None, ["parallel.recompute=full", "parallel.pipeline=2"]).parallel
    assert recompute_settings(spec, full) == {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,  # a stage's layers: 4 over 2 stages
    }
    with pytest.raises(ConfigError, match="recompute_layers.*needs recompute"):
        load_config(None, ["parallel.recompute_layers=2"])
    too_many = load_config(None, ["parallel.recompute=full", "parallel.pipeline=2", "parallel.recompute_layers=3"])
    with pytest.raises(ConfigError, match="exceeds the 2 layers of a pipeline stage"):
        validate(too_many, spec, world_size=2)
    replayed = load_config(None, ["parallel.recompute=full", "algo.routing_replay=true"])
    with pytest.raises(ConfigError, match="parallel.recompute.*routing_replay"):
        validate(replayed, tiny_spec("qwen3_moe"), world_size=1)
    selective = load_config(None, ["parallel.recompute=selective", "algo.routing_replay=true"])
    validate(selective, tiny_spec("qwen3_moe"), world_size=1)  # core attention only: the routers run once


def test_full_recompute_keeps_each_recomputed_layers_input_and_rebuilds_one_at_a_time():
    from bapo_megatron.trainer.memory import activation_bytes, layer_activation_bytes, recomputed_layers

    spec = tiny_spec()
    plain = load_config(None, ["parallel.pipeline=2"])
    full = load_config(None, ["parallel.pipeline=2", "parallel.recompute=full", "parallel.recompute_layers=1"])
    assert recomputed_layers(spec, full.parallel, 0) == [0] and recomputed_layers(spec, full.parallel, 1) == [2]
    tokens, layer = 1000, layer_activation_bytes(spec, plain.model, plain.parallel, 0)  # every layer alike here
    before = activation_bytes(spec, plain.model, plain.parallel, tokens, 0)
    after = activation_bytes(spec, full.model, full.parallel, tokens, 0)
    # stage 0 holds 2 micro-batches in flight: layer 0 keeps its fp32 input (64 x 4 bytes) instead of all
    assert before - after == 2 * tokens * (layer - 64 * 4) - tokens * layer
    selective = load_config(None, ["parallel.pipeline=2", "parallel.recompute=selective"])
    assert activation_bytes(spec, selective.model, selective.parallel, tokens, 0) == before
