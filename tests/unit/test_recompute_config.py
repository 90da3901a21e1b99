"""parallel.recompute: what cannot work is refused before anything starts, naming the field."""

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.preflight import validate
from bapo_megatron.trainer.megatron_config import recompute_settings

TE = "model.transformer_impl=transformer_engine"  # the flash-attention estimate (the local one has its own test)


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
    for recompute in ("selective", "full"):  # a rerun router replays its micro-batch's routes (tests/dist)
        replayed = load_config(None, [f"parallel.recompute={recompute}", "algo.routing_replay=true"])
        validate(replayed, tiny_spec("qwen3_moe"), world_size=1)


def test_full_recompute_keeps_each_recomputed_layers_input_and_rebuilds_one_at_a_time():
    from bapo_megatron.trainer.memory.estimate import activation_bytes, layer_activation_bytes, recomputed_layers

    spec = tiny_spec()
    plain = load_config(None, [TE, "parallel.pipeline=2"])
    full = load_config(None, [TE, "parallel.pipeline=2", "parallel.recompute=full", "parallel.recompute_layers=1"])
    assert recomputed_layers(spec, full.parallel, 0) == [0] and recomputed_layers(spec, full.parallel, 1) == [2]
    tokens, layer = 1000, layer_activation_bytes(spec, plain.model, plain.parallel, 0)  # every layer alike here
    before = activation_bytes(spec, plain.model, plain.parallel, tokens, 0)
    after = activation_bytes(spec, full.model, full.parallel, tokens, 0)
    # stage 0 holds 2 micro-batches in flight: layer 0 keeps its fp32 input (64 x 4 bytes) instead of all
    assert before - after == 2 * tokens * (layer - 64 * 4) - tokens * layer
    selective = load_config(None, [TE, "parallel.pipeline=2", "parallel.recompute=selective"])
    assert activation_bytes(spec, selective.model, selective.parallel, tokens, 0) == before


GIB = 2**30
QWEN32B = ["model.hf_path=examples/qwen2.5-32b/shape", "model.transformer_impl=transformer_engine"]
LAYOUT = ["model.precision=bf16", "parallel.tensor=8", "parallel.pipeline=2", "parallel.sequence_parallel=true"]


def _qwen32b(new_tokens: int, *more: str):
    """The 32B preset's layout (TP 8 x PP 2, DP 2 on 32 GPUs) with responses of new_tokens after 2k-token prompts."""
    from bapo_megatron.preflight import model_spec

    length = [
        f"rollout.sampling.max_new_tokens={new_tokens}",
        f"parallel.max_tokens_per_microbatch={new_tokens + 2048}",
    ]
    cfg = load_config(None, [*QWEN32B, *LAYOUT, *length, "parallel.recompute=auto", *more])
    return cfg, model_spec(cfg)


def test_auto_takes_the_least_recompute_whose_estimate_fits():
    import dataclasses

    from bapo_megatron.trainer.memory.fit import fit_to_gpu, peak_bytes, usable_bytes

    usable = usable_bytes(80 * GIB)
    assert usable == 73 * GIB  # 80 GiB less 3 GiB and 5%
    cfg, spec = _qwen32b(16384)
    fitted = fit_to_gpu(cfg, spec, 32, 80 * GIB)
    assert fitted.cfg.parallel.recompute == "none" and "auto chose none" in fitted.line  # 56.1 GiB fits
    cfg, spec = _qwen32b(32768)
    fitted = fit_to_gpu(cfg, spec, 32, 80 * GIB)
    p = fitted.cfg.parallel
    assert (p.recompute, p.recompute_layers) == ("full", 8)
    assert peak_bytes(cfg, spec, p, 2) <= usable < peak_bytes(cfg, spec, dataclasses.replace(p, recompute_layers=7), 2)
    # Transformer Engine's attention keeps nothing that selective recompute saves: it never fits where none does not
    selective = dataclasses.replace(p, recompute="selective", recompute_layers=None)
    assert peak_bytes(cfg, spec, selective, 2) > usable
    assert (
        "auto chose full: 8 of the 32 layers of each pipeline stage" in fitted.line
        and "+8% step compute" in fitted.line
    )
    assert fit_to_gpu(cfg, spec, 32, 141 * GIB).cfg.parallel.recompute == "none"  # an H200 needs none
    kl, spec = _qwen32b(32768, "algo.kl_coef=0.1")  # the KL loss's reference model takes room: more recompute
    assert fit_to_gpu(kl, spec, 32, 80 * GIB).cfg.parallel.recompute_layers == 10
    # no GPU (a CPU run): nothing to fit, none
    fitted = fit_to_gpu(cfg, spec, 32, None)
    assert fitted.cfg.parallel.recompute == "none" and "no GPU" in fitted.line


def test_auto_tries_selective_before_full(monkeypatch):
    """The order of the options, with an estimate where selective recompute saves memory (core
    attention's activations counted, as for the local implementation)."""
    from bapo_megatron.trainer.memory import fit

    cost = {"none": 90, "selective": 70, "full": 40}
    monkeypatch.setattr(fit, "peak_bytes", lambda cfg, spec, p, dp: cost[p.recompute] * GIB)
    cfg, spec = _qwen32b(32768)
    assert fit.fit_to_gpu(cfg, spec, 32, 80 * GIB).cfg.parallel.recompute == "selective"
    cost["selective"] = 75
    chosen = fit.fit_to_gpu(cfg, spec, 32, 80 * GIB).cfg.parallel
    assert (chosen.recompute, chosen.recompute_layers) == ("full", 1)


def test_auto_refuses_what_nothing_fits_saying_what_would():
    from bapo_megatron.trainer.memory.fit import fit_to_gpu, longest_response, recompute_options

    cfg, spec = _qwen32b(65536)
    with pytest.raises(ConfigError) as err:
        fit_to_gpu(cfg, spec, 32, 40 * GIB)
    message = str(err.value)
    assert message.startswith("parallel.recompute='auto': does not fit: with the most recompute there is (full: 32 of")
    assert "the estimated peak is 35.6 GiB a GPU, more than the 35.0 GiB usable of each 40 GiB GPU" in message
    assert "parallel.pipeline=4 (32 GPUs, DP 1: recompute full:" in message  # twice the pipeline fits
    longest = longest_response(cfg, spec, 2, 40 * GIB).tokens
    assert f"parallel.max_tokens_per_microbatch={longest + 2048} or less" in message
    # routing replay of a MoE model keeps full recompute among the options (a rerun replays its routes)
    replayed = load_config(None, ["parallel.recompute=auto", "algo.routing_replay=true"])
    moe = tiny_spec("qwen3_moe")
    assert recompute_options(replayed, moe)[-1].recompute == "full"


def test_longest_response_and_what_it_costs():
    from bapo_megatron.trainer.memory.fit import longest_response, nominal_bytes, recompute_cost

    cfg, spec = _qwen32b(32768)
    most, plain = longest_response(cfg, spec, 2, 80 * GIB), longest_response(cfg, spec, 2, 80 * GIB, recompute=False)
    assert plain.tokens == 25781 and plain.parallel.recompute == "none"
    assert most.tokens == 131072 - 2048 and most.context  # the model's context, before memory
    assert (most.parallel.recompute, most.parallel.recompute_layers) == ("full", 27)
    # a recomputed layer is about one more forward of it: all of them about a third more compute
    everything = load_config(None, [*QWEN32B, *LAYOUT, "parallel.recompute=full"]).parallel
    assert 0.30 < recompute_cost(spec, everything, 34816) < 1 / 3
    assert nominal_bytes(81089 << 20) == 80 * GIB  # what CUDA reports of an H100 is the 80 GiB of a dry run
