"""LoRA on the Megatron layers against PEFT's LoRA on the transformers model, and TP 2 (with sequence
parallel) and PP 2 against one process.

One launch of two processes (gloo, CPU). At TP 1 each process checks, for a tiny Qwen2 (q, v and
down projections: the fused q/k/v output touched in its q and v rows only) and a tiny Qwen3 (q/k
norms, every projection): fresh adapters leave the logits bit for bit the base's (B starts at zero,
as PEFT's), and with the same random adapters in both, PEFT's logits and A and B gradients (and with
the adapters off, trainer/lora.adapters_off, the base's logits bit for bit). Then
the Qwen3 model (tied embeddings) takes one Adam step at TP 1 (the two processes as data parallel
ranks with the same batch: one process's step), TP 2 with sequence parallel, and PP 2 with full
activation recompute (the frozen embedding's output must carry a gradient into it), through
Megatron's DDP, optimizer and schedule: the loss, the adapters' gradients and updated values agree
within 1e-5, only the adapters have gradient buffers and optimizer state, and the base is unchanged
bit for bit.
"""

import dataclasses
from pathlib import Path

import torch

from tests.dist.launch import run_workers

RANK, ALPHA = 4, 8.0
PARITY = {"qwen2": ("q_proj", "v_proj", "down_proj"), "qwen3": ("all-linear",)}
LAYOUTS = {"tp1": (1, 1, False), "tp2sp": (2, 1, False), "pp2-recompute": (1, 2, True)}
"""name: (tensor, pipeline, full activation recompute); tensor 2 runs sequence parallel."""
SEQ, MICRO_BATCHES = 16, 2


def _spec(arch: str):
    from bapo_megatron.models.spec import tiny_spec

    return dataclasses.replace(tiny_spec(arch), tie_embeddings=arch == "qwen3")


def _lora(targets: tuple[str, ...], dropout: float = 0.0):
    from bapo_megatron.config.lora import LoRAConfig

    return LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets, dropout=dropout)


def _setup(tp: int, pp: int, recompute: bool = False):
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import destroy_model_parallel, init_model_parallel

    activate_cpu_shim()
    destroy_model_parallel()
    overrides = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.sequence_parallel={tp > 1}"]
    # Adam's first step is lr * g / (|g| + eps): an adapter gradient element near eps turns float32
    # summation-order noise between layouts into a visible update; 1e-5 keeps the comparison
    # well-conditioned without changing what is compared (tests/dist/test_trainer_parity.py's reason)
    overrides += ["optimizer.lr=1e-3", "optimizer.clip_grad=1.0", "optimizer.adam_eps=1e-5"]
    overrides.append(f"parallel.recompute={'full' if recompute else 'none'}")
    cfg = load_config(None, overrides)
    init_model_parallel(cfg.parallel, cfg.seed)
    return cfg


def _base(hf_dir: Path, cfg, pre: bool = True, post: bool = True):
    """The Megatron chunk with the HF weights (each rank its slices) and no adapters yet."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.weights.hf_load import load_hf_weights

    hf = HFCheckpoint(hf_dir)
    gpt = mc.build_gpt_model(hf.spec, cfg.model, cfg.parallel, pre_process=pre, post_process=post)
    load_hf_weights([gpt], hf.spec, hf, mc.padded_vocab(hf.spec, cfg.model, cfg.parallel))
    return gpt


def _random_adapters(spec, lora) -> dict[str, torch.Tensor]:
    """Whole (TP 1) adapter matrices by Megatron name, B nonzero so that A has a gradient."""
    from bapo_megatron.models.lora import adapter_names

    g = torch.Generator().manual_seed(3)
    return {name: 0.1 * torch.randn(_whole_shape(spec, lora, name), generator=g) for name in adapter_names(spec, lora)}


def _whole_shape(spec, lora, name: str) -> tuple[int, int]:
    from bapo_megatron.models.lora import layer_targets, megatron_name

    layer = int(name.split(".")[2])
    for t in layer_targets(spec, lora, layer):
        if name == megatron_name(layer, t, "A"):
            return (lora.rank, t.in_features)
        if name == megatron_name(layer, t, "B"):
            return (t.out_features, lora.rank)
    raise KeyError(name)


def _global(gpt, name: str) -> str:
    """A chunk-local parameter name with its global layer number."""
    if not name.startswith("decoder.layers."):
        return name
    _, _, local, rest = name.split(".", 3)
    return f"decoder.layers.{gpt.decoder.layers[int(local)].layer_number - 1}.{rest}"


def _slice(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of a whole adapter matrix (Megatron's attributes say which dimension)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return whole
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return whole.chunk(tp, dim=param.partition_dim)[rank]


def _set_adapters(gpt, whole: dict[str, torch.Tensor]) -> None:
    from bapo_megatron.trainer.lora import adapter_parameters

    with torch.no_grad():
        for name, param in adapter_parameters(gpt).items():
            param.copy_(_slice(whole[_global(gpt, name)], param))


def _tokens(spec, seed: int = 0) -> torch.Tensor:
    return torch.randint(spec.vocab_size, (MICRO_BATCHES, SEQ + 1), generator=torch.Generator().manual_seed(seed))


# -- Megatron against PEFT, at TP 1


def _peft_model(hf_dir: Path, spec, lora, whole: dict[str, torch.Tensor]):
    import peft
    import transformers

    from bapo_megatron.models.lora import adapter_names

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,
        target_modules="all-linear" if lora.target_modules == ("all-linear",) else list(lora.target_modules),
    )
    model = peft.get_peft_model(hf_model, config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, theirs in adapter_names(spec, lora).items():
            params[theirs.replace(".weight", ".default.weight")].copy_(whole[ours])
    trained = {n for n, p in params.items() if p.requires_grad}
    assert trained == {n.replace(".weight", ".default.weight") for n in adapter_names(spec, lora).values()}
    return model, params


def _check_against_peft(hf_dir: Path, cfg, arch: str) -> None:
    from bapo_megatron.models.lora import adapter_names
    from bapo_megatron.trainer.lora import adapter_parameters, adapters_off, apply_lora

    spec, lora = _spec(arch), _lora(PARITY[arch])
    gpt = _base(hf_dir, cfg).eval()
    ids = _tokens(spec)[:, :SEQ]
    positions = torch.arange(SEQ).expand_as(ids)
    with torch.no_grad():
        base = gpt(ids, positions, attention_mask=None)
    apply_lora(gpt, spec, lora)
    assert set(map(_global_of(gpt), adapter_parameters(gpt))) == set(adapter_names(spec, lora))
    with torch.no_grad():
        assert torch.equal(gpt(ids, positions, attention_mask=None), base), f"{arch}: fresh adapters moved the logits"
    whole = _random_adapters(spec, lora)
    _set_adapters(gpt, whole)
    peft_model, peft_params = _peft_model(hf_dir, spec, lora, whole)
    weights = torch.randn(*ids.shape, spec.vocab_size, generator=torch.Generator().manual_seed(5))
    ours = gpt(ids, positions, attention_mask=None)[..., : spec.vocab_size]
    theirs = peft_model(input_ids=ids).logits
    assert (ours - base[..., : spec.vocab_size]).abs().max() > 1e-3, "the adapters change the logits"
    with torch.no_grad(), adapters_off([gpt]):  # a LoRA run's KL reference: the base, bit for bit
        assert torch.equal(gpt(ids, positions, attention_mask=None), base), f"{arch}: adapters off is not the base"
    gap = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert gap <= 1e-5, f"{arch}: logits differ from PEFT's by {gap:.2e}"
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for name, param in adapter_parameters(gpt).items():
        theirs_name = adapter_names(spec, lora)[_global(gpt, name)].replace(".weight", ".default.weight")
        want = peft_params[theirs_name].grad
        gap = (torch.linalg.norm(param.grad - want) / torch.linalg.norm(want)).item()
        assert gap <= 1e-5, f"{arch} {name}: gradient differs from PEFT's by {gap:.2e}"


def _global_of(gpt):
    return lambda name: _global(gpt, name)


# -- one step at each layout


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    losses = model(ids, torch.arange(SEQ).expand_as(ids), attention_mask=None, labels=labels)

    def loss_func(per_token: torch.Tensor):
        total = per_token.sum()
        return total, torch.tensor(per_token.numel()), {"loss": total.detach().clone()}

    return losses, loss_func


def _step(
    hf_dir: Path, whole: dict[str, torch.Tensor], tp: int, pp: int, recompute: bool = False, dropout: float = 0.0
) -> dict:
    """One Adam step of the adapters at the layout: the loss (last stage), and by global name each
    adapter's gradient and updated value (this rank's slices) and whether the base stayed put."""
    from megatron.core import parallel_state as ps

    from bapo_megatron.trainer.lora import apply_lora

    cfg = _setup(tp, pp, recompute)
    spec, lora = _spec("qwen3"), _lora(PARITY["qwen3"], dropout)
    gpt = _base(hf_dir, cfg, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    apply_lora(gpt, spec, lora)
    _set_adapters(gpt, whole)
    base = {n: p.detach().clone() for n, p in gpt.named_parameters() if not p.requires_grad}
    _check_checkpoint_shards(gpt, spec, lora)
    step = _adam_step(gpt, cfg, spec, _global, lambda name, p, rank: _part(p, tp, rank))
    step["base_kept"] = all(torch.equal(p, base[n]) for n, p in gpt.named_parameters() if n in base)
    return step


def _check_checkpoint_shards(gpt, spec, lora) -> None:
    """Each adapter's dist-checkpoint entry describes the whole (TP 1) matrix, this rank holding its
    part, as a replica of this data-parallel rank's (two DP ranks both claiming the main replica made
    a LoRA run at DP 2 fail its first save: "Invalid access pattern")."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bapo_megatron.models.lora import is_adapter
    from bapo_megatron.trainer.lora import adapter_parameters

    names = {id(p): _global(gpt, n) for n, p in adapter_parameters(gpt).items()}
    entries = [sh for sh in nested_values(gpt.sharded_state_dict()) if isinstance(sh, ShardedTensor)]
    adapters = [sh for sh in entries if is_adapter(sh.key)]
    assert {id(sh.data) for sh in adapters} == set(names)
    for sh in adapters:
        whole = _whole_shape(spec, lora, names[id(sh.data)])
        assert tuple(sh.global_shape[sh.prepend_axis_num :]) == whole, (sh.key, sh.global_shape, whole)
        assert tuple(sh.local_shape) == tuple(sh.data.shape)
        assert sh.replica_id[-1] == ps.get_data_parallel_rank(with_context_parallel=True), (sh.key, sh.replica_id)


def _adam_step(gpt, cfg, spec, global_name, part_of) -> dict:
    """One Adam step of `gpt`'s adapters through Megatron's DDP, optimizer and schedule on the test
    batch (its gradient buffers and optimizer holding the adapters alone): the loss (the last
    stage's; None elsewhere) and, by global_name(local name), each adapter's gradient, updated value and
    part_of(local name, parameter, TP rank) (what of the whole matrix this rank holds)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.lora import adapter_parameters

    ddp = DistributedDataParallel(config=gpt.config, ddp_config=mc.ddp_config(cfg.model), module=gpt)
    adapters = adapter_parameters(gpt)
    buffered = {id(p) for buffer in (*ddp.buffers, *ddp.expert_parallel_buffers) for p in buffer.params}
    assert buffered == {id(p) for p in adapters.values()}, "gradient buffers hold only the adapters"
    optimizer = get_megatron_optimizer(mc.optimizer_config(cfg.optimizer, cfg.model), [ddp])
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in adapters.values()}, "the optimizer holds only the adapters"
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.grad_scale_func = optimizer.scale_loss
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(_tokens(spec, seed=1).split(1)),
        model=ddp,
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    grads = {global_name(gpt, n): p.main_grad.clone() for n, p in adapters.items()}
    assert optimizer.step()[0], "the step was taken"
    rank = ps.get_tensor_model_parallel_rank()
    return {
        "loss": sum(r["loss"] for r in reports).item() if reports else None,  # (the last stage's)
        "grads": grads,
        "values": {global_name(gpt, n): p.detach().clone() for n, p in adapters.items()},
        "part": {global_name(gpt, n): part_of(n, p, rank) for n, p in adapters.items()},
    }


def _part(param: torch.Tensor, tp: int, rank: int):
    """What of a whole matrix this rank's `param` is."""
    dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    return lambda whole: whole if dim is None else whole.chunk(tp, dim=dim)[rank]


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return (torch.linalg.norm(got - want) / torch.linalg.norm(want).clamp(min=1e-12)).item()


def _worker(rank: int, world: int, root: str) -> None:
    root_dir = Path(root)
    cfg = _setup(1, 1)
    for arch in PARITY:
        _check_against_peft(root_dir / arch, cfg, arch)
    spec = _spec("qwen3")
    whole = _random_adapters(spec, _lora(PARITY["qwen3"]))
    results = {name: _step(root_dir / "qwen3", whole, *layout) for name, layout in LAYOUTS.items()}
    want = results.pop("tp1")
    assert want["base_kept"]
    assert any(not torch.equal(want["values"][n], whole[n]) for n in want["values"]), "the step moved the adapters"
    for layout, got in results.items():
        assert got["base_kept"], f"{layout}: the base weights changed"
        if got["loss"] is not None:
            assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (layout, got["loss"], want["loss"])
        worst = 0.0
        for key, part in got["part"].items():
            for what in ("grads", "values"):
                gap = _close(got[what][key], part(want[what][key]))
                assert gap <= 1e-5, f"{layout} {key}: {what} differ from one process's by {gap:.2e}"
                worst = max(worst, gap)
        print(f"{layout}: worst adapter relative difference {worst:.2e}")
    _check_dropout_keeps_whole_matrices_equal(root_dir / "qwen3", whole)


def _check_dropout_keeps_whole_matrices_equal(hf_dir: Path, whole: dict[str, torch.Tensor]) -> None:
    """With dropout at TP 2 (sequence parallel), a matrix every TP rank holds whole (A beside a
    column-parallel layer, B beside a row-parallel one) is still the same on both after a step:
    the whole input takes one mask on every rank."""
    import torch.distributed as dist

    got = _step(hf_dir, whole, 2, 1, dropout=0.5)
    for key, part in got["part"].items():
        if part(whole[key]) is whole[key]:
            both = [torch.empty_like(got["values"][key]) for _ in range(2)]
            dist.all_gather(both, got["values"][key].contiguous())
            assert torch.equal(both[0], both[1]), f"{key}: the TP ranks' copies differ after a step with dropout"


def test_lora_against_peft_and_layouts(tmp_path):
    from tests.families import random_hf_model, save_hf_model

    for seed, arch in enumerate(PARITY):
        spec = _spec(arch)
        save_hf_model(random_hf_model(spec, seed), spec, tmp_path / arch)
    run_workers(_worker, 2, str(tmp_path))
