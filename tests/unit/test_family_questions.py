"""What the trainer's packing and the embedded engine's route record ask a model family, answered
by toy families registered here: one whose layers would mix a packed row's samples
(Family.packing_leak) is trained one sample a row, or refused packed, and the dry run says why;
one that routes has its own hooks record the routes (Family.hook_routes)."""

import json

import pytest
import torch

from bapo_megatron.config import ModelConfig, ParallelConfig, load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.models import FAMILIES
from bapo_megatron.models.features import MoESpec
from bapo_megatron.models.qwen2 import Qwen2
from bapo_megatron.models.qwen3_moe import Qwen3Moe
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from tests.helpers import make_batch

LEAK = "toy recurrent mixer"


class Unpackable(Qwen2):
    """A family whose layers would carry a state across a packed row's samples."""

    name = "unpackable"
    architectures = ("UnpackableForCausalLM",)

    def to_hf(self, spec):
        return {**super().to_hf(spec), "architectures": list(self.architectures), "model_type": self.name}

    def tiny(self):
        return ModelSpec(**{**super().tiny().as_dict(), "architecture": self.name})

    def packing_leak(self, spec, te):
        return LEAK


@pytest.fixture
def unpackable(monkeypatch) -> ModelSpec:
    monkeypatch.setitem(FAMILIES, Unpackable.name, Unpackable())
    return Unpackable().tiny()


def test_a_model_whose_layers_mix_a_row_is_trained_one_sample_a_row(unpackable):
    from bapo_megatron.trainer.packing import PackedLayout, PaddedLayout, microbatch_layout

    te = ModelConfig(transformer_impl="transformer_engine")
    vpp = ParallelConfig(pipeline=2, virtual_pipeline=2)
    for model, parallel in [(te, ParallelConfig()), (ModelConfig(), vpp)]:  # where auto packs the others
        assert isinstance(microbatch_layout(tiny_spec(), model, parallel, 1), PackedLayout)
        layout = microbatch_layout(unpackable, model, parallel, 1)
        assert isinstance(layout, PaddedLayout) and layout.uniform == (parallel.virtual_pipeline is not None)
        batch = make_batch(0, groups=1, n=4, max_len=12)
        mine = layout.plan([s.length for s in batch.samples], 1, 2)[0]
        for mb in layout.build(batch.samples, mine, [0.0] * 4):
            assert mb.cu_seqlens is None and mb.input_ids.shape[0] == len(mb.sample_index)  # a row each
    with pytest.raises(ConfigError, match=f"parallel.packing='packed': unpackable's {LEAK} would mix") as refused:
        microbatch_layout(unpackable, ModelConfig(), ParallelConfig(packing="packed"), 1)
    assert refused.value.field == "parallel.packing"


def test_the_dry_run_says_why_it_does_not_pack_and_refuses_what_the_run_refuses(unpackable, tmp_path):
    from bapo_megatron.cli.dry_run import dry_run
    from bapo_megatron.cli.dry_run_memory import GIB

    (tmp_path / "config.json").write_text(json.dumps(Unpackable().to_hf(unpackable)))
    vpp = [f"model.hf_path={tmp_path}", "parallel.pipeline=2", "parallel.virtual_pipeline=2"]
    out = dry_run(load_config(None, vpp), 2, 80 * GIB)
    line = next(line for line in out.splitlines() if line.startswith("micro-batches: "))
    assert line.startswith(
        f"micro-batches: padded rows of one sample each (not packed: unpackable's {LEAK} would mix the samples of "
        "a packed row), padded to the step's longest"
    ), line
    with pytest.raises(ConfigError, match=f"unpackable's {LEAK}"):  # plan_run: the run's checks
        dry_run(load_config(None, [*vpp, "parallel.packing=packed"]), 2, 80 * GIB)


# -- routes


class ToyRouted(Qwen3Moe):
    """A routed family whose routes come from its own hooks (here: on whole layers, each position's
    experts made up from its input), in layers 1 and 3."""

    name = "toy_routed"
    hooked = (1, 3)

    def hook_routes(self, model, record):
        for slot, layer in enumerate(self.hooked):

            def hook(module, args, output, slot=slot):
                x = args[0].reshape(-1, args[0].shape[-1])
                record(slot, x[:, :2].long() % 4)

            model.model.layers[layer].register_forward_hook(hook)
        return self.hooked


def _layers(n: int) -> torch.nn.Module:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(n))
    return model


def _routed_spec(sparse: tuple[int, ...]) -> ModelSpec:
    moe = MoESpec(num_experts=4, top_k=2, ffn_hidden_size=32, norm_topk_prob=True, sparse_layers=sparse)
    return ModelSpec(**{**tiny_spec("qwen3_moe").as_dict(), "architecture": ToyRouted.name, "moe": moe})


def test_the_route_recorder_records_what_the_familys_hooks_give(monkeypatch):
    from bapo_megatron.engines.embedded.routing import RouteRecorder

    monkeypatch.setitem(FAMILIES, ToyRouted.name, ToyRouted())
    model = _layers(4)
    recorder = RouteRecorder.of(model, _routed_spec((1, 3)))
    assert recorder.sparse_layers == (1, 3) and recorder.top_k == 2
    x = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    for layer in model.model.layers:
        layer(x)
    routes = recorder.take(rows=2)
    assert routes.shape == (2, 3, 2, 2) and routes.dtype == torch.uint8
    assert torch.equal(routes[:, :, 0], (x[..., :2].long() % 4).to(torch.uint8))
    with pytest.raises(ValueError, match=r"hooked in layers \(1, 3\), its config.json routes in \(1, 2, 3\)"):
        RouteRecorder.of(_layers(4), _routed_spec((1, 2, 3)))
    assert RouteRecorder.of(_layers(4), tiny_spec()) is None  # dense: nothing hooked


def test_qwen3_moes_hooks_record_the_experts_transformers_routes_to():
    """Against transformers' own router logits (output_router_logits), top-k of their softmax."""
    import transformers

    from bapo_megatron.engines.embedded.routing import RouteRecorder

    spec = tiny_spec("qwen3_moe")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**spec.to_hf_config())).eval()
    recorder = RouteRecorder.of(model, spec)
    ids = torch.randint(0, spec.vocab_size, (2, 5))
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    routes = recorder.take(rows=2)
    want = torch.stack([lg.softmax(-1).topk(spec.moe.top_k, dim=-1).indices for lg in logits], dim=1)
    assert recorder.sparse_layers == spec.moe.sparse_layers
    assert torch.equal(routes.view(-1, *routes.shape[2:]).long().sort(-1).values, want.sort(-1).values)
