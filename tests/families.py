"""A model family's checks, shared by the families' tests (tests/dist/test_family_<name>.py).

    from tests.families import FamilyCase, SGLangLoader, check_family

    def test_glm4_moe_family(tmp_path):
        check_family(tmp_path, FamilyCase("glm4_moe", sglang=SGLangLoader("models/glm4_moe.py")))

check_family runs two launches:
1. one process: the family's tiny model made in transformers with random weights (norms, routers,
   biases and buffers such as an expert bias included), mapped to Megatron (weights/layout): logits
   equal to transformers' (relative to their largest, <= case.tolerance, fp32; for every spec of
   case.variants too) and the map back bitwise; a routed model's routers choose transformers'
   experts the embedded engine records (Family.hook_routes) in every layer (Megatron orders tokens
   sequence-first, transformers batch-first). The converter both ways (hf-to-mcore, verify,
   mcore-to-hf: bitwise; in bfloat16, rounded once, float32 tensors kept). Then the reference: one BAPO
   step of PolicyTrainer from the converted checkpoint (a routed model replaying random routes),
   its updated weights exported live; a routed model also replays its own routes (router
   disagreement 0).
2. two processes, Megatron's parallel state re-initialised for each layout of case.layouts (TP 2
   with sequence parallel, PP 2, and EP 2 for a routed model): the same step from the converted
   checkpoint, its live export equal to the reference (the updated weights: gradients checked).
   Each layout loads the HF directory (each rank its slices) and the converted checkpoint: the same.
Then, in the calling process, the export's names (and those of each variant's checkpoint) go through
the family's SGLang loader when case.sglang names it (its load_weights name mapping, run from the
wheel's source: check_sglang_names, which the families' own tests call too).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bapo_megatron.common.hf_io import expected_shapes
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from tests.dist.launch import run_workers

TOOLS = Path(__file__).resolve().parents[1] / "tools"
STEP = (
    "algo.loss=bapo",
    "algo.bapo.target_rho=0.45",
    "parallel.max_tokens_per_microbatch=48",
    "optimizer.lr=1e-3",
    "optimizer.adam_eps=1e-6",
)
"""One BAPO step that moves every weight (as tests/dist/test_moe_parity.py takes it)."""
COMPARED = ("loss/pg", "train/grad_norm", "policy/entropy")
ROUTED = ("moe/load_max", "moe/router_disagreement")
"""A routed model's figures compared too: the experts' load, the routers' own choices against the replayed."""


@dataclass(frozen=True)
class FamilyCase:
    """What check_family checks of one family."""

    architecture: str
    """The family's name (models.FAMILIES)."""
    sglang: SGLangLoader | None = None
    """The family's loader in SGLang's wheel (e.g. SGLangLoader("models/glm4_moe.py")); None: not checked."""
    spec: ModelSpec | None = None
    """The model trained and converted (default: the family's tiny())."""
    variants: tuple[ModelSpec, ...] = ()
    """Further specs whose logits are checked against transformers (features tiny() leaves out)."""
    layouts: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """name: (tensor, pipeline, expert) on two processes (default: tp2, pp2 and, routed, ep2)."""
    tolerance: float = 1e-5
    hf_convention: Callable[[Any], None] | None = None
    """Applied to each transformers reference model before its logits are compared: where transformers
    computes otherwise than SGLang, which the trainer follows (a module-level function: it goes to
    the worker processes)."""

    def model(self) -> ModelSpec:
        return self.spec or tiny_spec(self.architecture)

    def parallel_layouts(self) -> dict[str, tuple[int, int, int]]:
        if self.layouts:
            return self.layouts
        routed = {"ep2": (1, 1, 2)} if self.model().moe is not None else {}
        return {"tp2": (2, 1, 1), "pp2": (1, 2, 1), **routed}


def check_family(root: Path, case: FamilyCase) -> None:
    """Every check above, for `case`, with its files under `root`."""
    run_workers(_one_process, 1, str(root), case)
    run_workers(_layouts, 2, str(root), case)
    if case.sglang is not None:
        check_sglang_names(case.sglang, torch.load(Path(root) / "reference-export.pt"), case.model())
        for variant in case.variants:  # the names a checkpoint of each has
            check_sglang_names(case.sglang, expected_shapes(variant), variant)


# -- models


def random_hf_model(spec: ModelSpec, seed: int = 0):
    """transformers' model of `spec` (fp32) with every parameter and saved buffer random: norms near 1,
    the rest (routers, an expert bias, biases) around 0 with spread 0.08."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**spec.to_hf_config()), dtype=torch.float32
    ).eval()
    saved = set(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in saved and tensor.is_floating_point():
                tensor.copy_((1.0 if "norm" in name else 0.0) + 0.08 * torch.randn(tensor.shape, generator=g))
    return model


def multimodal_qwen3_5_config(spec: ModelSpec):
    """transformers' Qwen3_5Config of the released multimodal layout around `spec`'s text model: a tiny
    vision tower (one block) beside it."""
    import transformers

    text = {k: v for k, v in spec.to_hf_config().items() if k != "architectures"}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4}
    return transformers.Qwen3_5Config(
        text_config=text,
        vision_config={**vision, "out_hidden_size": spec.hidden_size, "num_position_embeddings": 16},
        tie_word_embeddings=spec.tie_embeddings,
    )


def save_hf_model(model, spec: ModelSpec, directory: Path) -> None:
    """`model` as a HF directory (several shards) with a word-level tokenizer of the vocabulary."""
    import tokenizers

    model.save_pretrained(directory, max_shard_size="200KB")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(spec.vocab_size)}, "t0"))
    tok.save(str(directory / "tokenizer.json"))


def hf_state(model) -> dict[str, torch.Tensor]:
    """A transformers model's tensors under the names of checkpoints on disk (one per expert)."""
    from bapo_megatron.common.hf_experts import per_expert

    return dict(per_expert(model.state_dict()))


def _setup(tp: int = 1, pp: int = 1, ep: int = 1, extra: tuple[str, ...] = ()):
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import destroy_model_parallel, init_model_parallel

    activate_cpu_shim()
    destroy_model_parallel()
    layout = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.expert={ep}"]
    cfg = load_config(None, [*STEP, *layout, f"parallel.sequence_parallel={tp > 1}", *extra])
    return cfg, init_model_parallel(cfg.parallel, cfg.seed)


# -- one process


def _one_process(rank: int, world: int, root: str, case: FamilyCase) -> None:
    root_dir = Path(root)
    cfg, _ = _setup()
    spec = case.model()
    for i, variant in enumerate((spec, *case.variants)):
        model = random_hf_model(variant, seed=i)
        if case.hf_convention is not None:
            case.hf_convention(model)
        megatron = check_logits(variant, model, cfg, case.tolerance)
        if i == 0:
            if spec.moe is not None:
                check_routes(spec, model, megatron)
            save_hf_model(model, spec, root_dir / "hf")
    check_conversion(root_dir, spec, case.tolerance)
    _reference_step(root_dir, spec)


def check_logits(spec: ModelSpec, hf_model, cfg, tolerance: float):
    """Megatron (TP 1) with `hf_model`'s weights mapped in: transformers' logits, and the map back
    bitwise; returns the Megatron model."""
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf

    hf = hf_state(hf_model)
    padded = mc.padded_vocab(spec, cfg.model, cfg.parallel)
    model = mc.build_gpt_model(spec, cfg.model, cfg.parallel, pre_process=True, post_process=True).eval()
    missing, unexpected = model.load_state_dict(hf_to_megatron(spec, hf, padded), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    ids, positions = _tokens(spec)
    with torch.no_grad():
        ours = model(ids, positions, attention_mask=None)[..., : spec.vocab_size]
        theirs = hf_model(ids).logits
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert rel <= tolerance, f"{spec.architecture}: logits differ by {rel:.2e} (relative) for {spec}"
    back = megatron_to_hf(spec, model.state_dict())
    expected = {k for k in hf if not (spec.tie_embeddings and k == "lm_head.weight")}
    assert set(back) == expected, sorted(set(back) ^ expected)[:4]
    for key in expected:
        assert torch.equal(back[key], hf[key]), key
    return model


def _tokens(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(spec.vocab_size, (2, 23), generator=torch.Generator().manual_seed(7))
    return ids, torch.arange(23).unsqueeze(0).expand(2, 23)


def check_routes(spec: ModelSpec, hf_model, megatron) -> None:
    """In every routed layer, Megatron's routers choose for each token the experts the embedded engine
    records transformers' routers choosing (the family's hook_routes); and transformers' choices
    depend on all the router adds to its logits (an expert bias: so the check can fail)."""
    from bapo_megatron.engines.embedded.routing import RouteRecorder

    ours = {}
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, a, out, i=layer.layer_number - 1: ours.__setitem__(i, out[1]))
        for layer in megatron.decoder.layers
        if spec.moe.is_sparse(layer.layer_number - 1)
    ]
    recorder = RouteRecorder.of(hf_model, spec)
    ids, positions = _tokens(spec)
    with torch.no_grad():
        megatron(ids, positions, attention_mask=None)
        hf_model(ids)
    for hook in hooks:
        hook.remove()
    batch, seq = ids.shape
    theirs = recorder.take(batch).long()  # [batch, seq, routed layers, top_k]
    for ordinal, layer in enumerate(spec.moe.sparse_layers):
        chosen = ours[layer].view(seq, batch, -1).transpose(0, 1)  # Megatron's tokens are sequence-first
        want = torch.zeros_like(chosen).scatter(2, theirs[:, :, ordinal], True)
        assert torch.equal(chosen, want), f"layer {layer}: Megatron's routes are not transformers'"
    if spec.moe.expert_bias:
        gates = [hf_model.model.layers[i].mlp.gate for i in spec.moe.sparse_layers]
        with torch.no_grad():
            biases = [gate.e_score_correction_bias.clone() for gate in gates]
            for gate in gates:
                gate.e_score_correction_bias.zero_()
            hf_model(ids)
            for gate, bias in zip(gates, biases, strict=True):
                gate.e_score_correction_bias.copy_(bias)
        assert not torch.equal(recorder.take(batch).long(), theirs), "the expert bias changes no route"


def check_conversion(root: Path, spec: ModelSpec, tolerance: float) -> None:
    """tools/convert_checkpoint.py both ways: the checkpoint's logits are transformers' (verify), and
    the HF files written back are bitwise the originals."""
    from safetensors.torch import load_file

    sys.path.insert(0, str(TOOLS))
    import convert_checkpoint as cli

    from bapo_megatron.models import family_of
    from bapo_megatron.weights.convert import verify_conversion

    hf, mcore, back = root / "hf", root / "mcore", root / "hf-back"
    assert cli.main(["hf-to-mcore", "--hf", str(hf), "--out", str(mcore), "--no-progress"]) == 0
    result = verify_conversion(hf, mcore)
    assert result["max_rel"] <= tolerance, result
    assert cli.main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(back), "--no-progress"]) == 0
    original = {k: t for f in sorted(hf.glob("*.safetensors")) for k, t in load_file(f).items()}
    returned = {k: t for f in sorted(back.glob("*.safetensors")) for k, t in load_file(f).items()}
    assert set(returned) == set(original), sorted(set(returned) ^ set(original))[:4]
    for key, tensor in original.items():
        assert torch.equal(returned[key], tensor), key
    # in bfloat16 both ways: every tensor rounded once, but those kept in float32 (an expert bias) bitwise
    half, half_back = root / "mcore-bf16", root / "hf-back-bf16"
    bf16 = ["--dtype", "bfloat16", "--no-progress"]
    assert cli.main(["hf-to-mcore", "--hf", str(hf), "--out", str(half), *bf16]) == 0
    assert cli.main(["mcore-to-hf", "--mcore", str(half), "--out", str(half_back), *bf16]) == 0
    returned = hf_state_of_dir(half_back)
    for key, tensor in original.items():
        want = tensor if family_of(spec).float32_tensor(key) else tensor.to(torch.bfloat16)
        assert returned[key].dtype == want.dtype and torch.equal(returned[key], want), key


# -- the training step, at one process and at each layout


def _batch(spec: ModelSpec):
    """A rollout batch; a routed model's samples carry random routes (distinct top-k experts per
    position and routed layer), which show any slip in how a layout slices them."""
    from tests.helpers import make_batch

    batch = make_batch(0, max_len=14, temperature=0.9)
    if spec.moe is not None:
        g = torch.Generator().manual_seed(1)
        moe = spec.moe
        for sample in batch.samples:
            scores = torch.rand(sample.length - 1, len(moe.sparse_layers), moe.num_experts, generator=g)
            sample.routes = scores.topk(moe.top_k, dim=-1).indices.to(torch.uint8)
    return batch


def _step(root: Path, spec: ModelSpec, tp: int, pp: int, ep: int):
    """PolicyTrainer at the layout from the converted checkpoint, after one step: (trainer, metrics, export)."""
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.gather import hf_buckets_to_rank0
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    replay = ("algo.routing_replay=true",) if spec.moe is not None else ()
    cfg, info = _setup(tp, pp, ep, replay)
    trainer = PolicyTrainer(spec, cfg, info)
    load_hf_into_trainer(trainer, root / "hf")  # each rank its slices, straight from safetensors
    from_hf = {k: v.clone() for k, v in _weights(trainer).items()}
    trainer.load_weights(root / "mcore")
    for key, tensor in _weights(trainer).items():
        assert torch.equal(tensor, from_hf[key]), f"{key}: the HF load and the converted checkpoint differ"
    result = trainer.train_step(_batch(spec))
    assert not result.skipped
    exported = {name: t.clone() for bucket in hf_buckets_to_rank0(trainer, 1 << 16) for name, t in bucket}
    return trainer, result.metrics, exported


def _weights(trainer) -> dict[str, torch.Tensor]:
    """This rank's model tensors (parameters and saved buffers), by chunk and name."""
    state = {}
    for i, chunk in enumerate(trainer.model):
        for name, tensor in chunk.module.state_dict().items():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                state[f"{i}.{name}"] = tensor
    return state


def _reference_step(root: Path, spec: ModelSpec) -> None:
    trainer, metrics, exported = _step(root, spec, 1, 1, 1)
    initial = hf_state_of_dir(root / "hf")
    assert list(exported) == [k for k in exported if k in initial] and set(exported) == set(initial)
    moved = [k for k, t in exported.items() if not torch.equal(t, initial[k])]
    assert any(".mlp." in k for k in moved) and any("self_attn" in k for k in moved), "the step trains the layers"
    torch.save(exported, root / "reference-export.pt")
    (root / "reference.json").write_text(json.dumps(metrics))
    if spec.moe is not None:
        _replay_own_routes(trainer, spec, root)


def hf_state_of_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: t for f in sorted(directory.glob("*.safetensors")) for k, t in load_file(f).items()}


def own_routes(trainer, batch) -> list[torch.Tensor]:
    """The experts the trainer's routers choose for each sample of `batch` (one process, no replay),
    as a sample's routes: [positions, routed layers, top_k] uint8."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        r.module.register_forward_hook(lambda m, a, out, o=r.ordinal: seen.__setitem__(o, out[1]))
        for r in trainer.routers.routers
    ]
    routes = [None] * len(batch)
    mbs, _ = trainer.microbatches(batch)
    with torch.no_grad():
        for mb in mbs:
            trainer.model[0](mb.input_ids, mb.position_ids, attention_mask=None)
            rows, seq = mb.input_ids.shape
            chosen = torch.stack([seen[o].view(seq, rows, -1) for o in sorted(seen)], dim=2)  # [s, b, layers, E]
            for row, i in enumerate(mb.sample_index):
                n = batch.samples[i].length - 1
                routes[i] = chosen[:n, row].nonzero()[:, 2].view(n, len(seen), -1).to(torch.uint8)
    for hook in hooks:
        hook.remove()
    return routes


def _replay_own_routes(trainer, spec: ModelSpec, root: Path) -> None:
    """Replaying the experts the routers choose themselves: no router disagrees with them."""
    batch = _batch(spec)
    for sample, routes in zip(batch.samples, own_routes(trainer, batch), strict=True):
        sample.routes = routes
    metrics = trainer.train_step(batch).metrics
    assert metrics["moe/router_disagreement"] == 0.0, metrics["moe/router_disagreement"]


# -- two processes


def _layouts(rank: int, world: int, root: str, case: FamilyCase) -> None:
    root_dir = Path(root)
    spec = case.model()
    want = json.loads((root_dir / "reference.json").read_text())
    reference = torch.load(root_dir / "reference-export.pt")
    for name, (tp, pp, ep) in case.parallel_layouts().items():
        _, metrics, exported = _step(root_dir, spec, tp, pp, ep)
        if rank != 0:
            continue
        for key in COMPARED + (ROUTED if spec.moe is not None else ()):
            assert abs(metrics[key] - want[key]) <= 1e-5 * abs(want[key]) + 1e-7, (name, key, metrics[key], want[key])
        assert list(exported) == list(reference), name
        for key, tensor in exported.items():
            gap = (torch.linalg.norm(tensor - reference[key]) / torch.linalg.norm(reference[key])).item()
            assert gap <= 1e-5, f"{name} {key}: updated weights differ by {gap:.3g} (relative norm)"


# -- SGLang


@dataclass(frozen=True)
class SGLangLoader:
    """A SGLang model's load_weights, as check_sglang_names replays it on our names (its files under
    sglang/srt/ in the wheel)."""

    loader: str
    """The file whose load_weights maps checkpoint names."""
    sources: tuple[str, ...] = ()
    """Further files whose classes the model builds on (the modules they assign count too)."""
    body_class: str | None = None
    """The class whose load_weights' stacked_params_mapping is read (None: the loader's first)."""
    stacked: Callable[[ModelSpec], tuple[tuple[str, str, object], ...]] | None = None
    """The stacked entries the loader applies in code for a model of a spec, beside its
    stacked_params_mapping (DeepSeek's fused query and kv down-projections; a module-level function)."""
    rules: tuple[tuple[str, str], ...] = ()
    """(file, source text) the replay relies on, asserted present in that file."""
    prefix: str = ""
    """What a wrapper strips from every name before the loader sees it (Qwen3.5's `model.`)."""
    dropped: str = ""
    """A part the loader removes from every name (Qwen3.5's `.self_attn`)."""
    own: tuple[str, ...] = ()
    """Names a module of the wrapper's own loads (Qwen3.5's lm_head.weight): not replayed."""


def check_sglang_names(loader: SGLangLoader, exported: Iterable[str], spec: ModelSpec) -> None:
    """Every exported name (of a model of `spec`) lands on a parameter of SGLang's model through the
    loader's own mapping: its load_weights' stacked_params_mapping (read from the wheel's source) and
    loader.stacked, skipped by the experts' names, then the experts through
    FusedMoE.make_expert_params_mapping (compiled from the wheel), the rest by name; each module on
    the way is one SGLang's model files (loader.loader, loader.sources) assign, each leaf a parameter
    its layers register or assign."""
    import zipfile

    import pytest

    from tests.sglang_wheel import WheelUnavailable, load_defs, source, wheel_path

    try:
        wheel = zipfile.ZipFile(wheel_path())
    except WheelUnavailable as err:
        pytest.skip(str(err))
    text = source(wheel, loader.loader)
    for file, rule in loader.rules:
        assert rule in source(wheel, file), (file, rule)
    stacked = [*(loader.stacked(spec) if loader.stacked else ()), *stacked_params_mapping(text, loader.body_class)]
    assert stacked, f"{loader.loader}: no stacked_params_mapping in load_weights"
    experts = []
    if spec.moe is not None:
        assert 'if "mlp.experts" in name:' in text or '("mlp.experts." in name)' in text  # stacked skip experts
        path = "layers/moe/fused_moe_triton/layer.py"
        make = load_defs(wheel, {path: ["FusedMoE.make_expert_params_mapping"]}, {})["make_expert_params_mapping"]
        names = {"ckpt_gate_proj_name": "gate_proj", "ckpt_down_proj_name": "down_proj", "ckpt_up_proj_name": "up_proj"}
        experts = make.__func__(None, **names, num_experts=spec.moe.num_experts)
    modules = assigned_modules([text, *(source(wheel, f) for f in loader.sources)])
    leaves = {"weight", "bias", *re.findall(r'register_parameter\("(\w+)"', source(wheel, UNQUANTIZED))}
    for name in exported:
        if name in loader.own:
            continue
        target = sglang_param(name.removeprefix(loader.prefix).replace(loader.dropped, ""), stacked, experts)
        *path, leaf = [part for part in target.split(".") if not part.isdigit()]
        assert leaf in leaves or leaf in modules, (name, target)
        missing = [part for part in path if part not in modules]
        assert not missing, f"{name} -> {target}: SGLang's model has no module {missing}"


UNQUANTIZED = "layers/quantization/unquant.py"
"""Where SGLang's unquantized layers register their parameters (FusedMoE's w13_weight and w2_weight)."""


def stacked_params_mapping(loader: str, body_class: str | None = None) -> list[tuple[str, str, object]]:
    """The (param, shard name, shard id) list a SGLang model file assigns first in its load_weights
    (in class `body_class`'s, when given)."""
    tree = ast.parse(loader)
    if body_class is not None:
        tree = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == body_class)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "stacked_params_mapping":
            return [tuple(t) for t in ast.literal_eval(node.value)]
    return []


def assigned_modules(sources: list[str]) -> set[str]:
    """The attribute names SGLang's model classes assign (self.NAME = ..., self.NAME, ... = ...)."""
    return {m for text in sources for m in re.findall(r"self\.(\w+)\s*[,=:]", text)}


def sglang_param(name: str, stacked: list, expert_mapping: list) -> str:
    """The SGLang parameter that HF tensor `name` loads into, as a loader's load_weights maps it:
    the first stacked entry whose shard name it contains (never an expert's), else the first expert
    mapping whose weight name it contains, else the name itself."""
    for param, weight, _ in stacked:
        if weight in name and "mlp.experts" not in name:
            return name.replace(weight, param)
    for param, weight, _, _ in expert_mapping:
        if weight in name:
            return name.replace(weight, param)
    return name
