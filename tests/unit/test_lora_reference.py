"""The KL reference under LoRA: the base with the adapters off (trainer/lora.adapters_off), as NeMo-RL
and verl take it, no second copy of the weights. Its log-probs are the base model's, bit for bit,
before any step and after steps that moved the adapters away from zero; the first step's KL is 0
exactly and a later one's is not; a checkpoint holds no reference and a resume measures the same KL.
And what the adapters keep for backward, measured on CPU (saved tensors, with the adapters on and
off), is the estimate's count (trainer/memory/adapters.py). One process, the tiny Qwen2, the CPU shim."""

from functools import partial
from pathlib import Path

import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch

BASE = ["algo.loss=ppo", "optimizer.lr=5e-2", "parallel.max_tokens_per_microbatch=48"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algo.kl_coef=0.5"]


def _logprobs(trainer, batch, reference: bool) -> list[torch.Tensor]:
    """Each micro-batch's log-probs of `batch`: the reference pass's, or the policy's own."""
    from bapo_megatron.trainer.policy_trainer import StepState

    mbs, _ = trainer.microbatches(batch)
    step = StepState(temperature=batch.temperature, first_update=True)
    if reference:
        trainer._reference_pass(step, mbs)
    else:
        with torch.no_grad():
            trainer._run(mbs, partial(trainer._reference_loss, step), forward_only=True)
    return [mb.ref_logprobs for mb in mbs]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _reference_worker(rank: int, world: int, root: str) -> None:
    from bapo_megatron.config import CheckpointConfig, load_config
    from bapo_megatron.models.lora import is_adapter
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    spec, batch = tiny_spec("qwen2"), make_batch(2, max_len=14)
    cfg = load_config(None, [*BASE, *LORA])
    info = init_model_parallel(cfg.parallel, cfg.seed)
    base = PolicyTrainer(spec, load_config(None, BASE), info)
    trainer = PolicyTrainer(spec, cfg, info)
    assert trainer.reference is None  # no frozen second copy of the model
    weights = dict(base.model[0].module.named_parameters())
    with torch.no_grad():
        for name, p in trainer.model[0].module.named_parameters():
            if not is_adapter(name):
                p.copy_(weights[name])
    trainer.hold_reference()
    want = _logprobs(base, batch, reference=False)
    assert _same(_logprobs(trainer, batch, reference=True), want)
    assert trainer.train_step(batch).metrics["loss/kl"] == 0.0  # B = 0: the policy is the base
    trainer.train_step(batch)
    assert any(torch.count_nonzero(p) for n, p in trainer.model[0].module.named_parameters() if "lora_B" in n)
    assert not _same(_logprobs(trainer, batch, reference=False), want)  # the adapters moved the policy
    assert _same(_logprobs(trainer, batch, reference=True), want)  # and the reference is the base still

    manager = CheckpointManager(CheckpointConfig(dir=str(Path(root) / "lora-kl")))
    saved = manager.save(trainer)
    from megatron.core import dist_checkpointing

    assert dist_checkpointing.load_common_state_dict(str(saved))["common"]["reference"] is False
    resumed = PolicyTrainer(spec, cfg, info)
    manager.load(resumed, saved)
    again, next_step = resumed.train_step(batch).metrics, trainer.train_step(batch).metrics
    assert again["loss/kl"] > 0 and again["loss/kl"] == next_step["loss/kl"]
    _adapters_keep_what_the_estimate_counts(spec)


def _kept_bytes(model, tokens: int) -> int:
    """Bytes of the distinct storages a forward of `tokens` tokens saves for backward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 250, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, torch.arange(tokens).unsqueeze(0), attention_mask=None)
    del out  # held until every saved tensor was seen (none freed and reused meanwhile)
    return sum(kept.values())


def _per_token(model, layers: int) -> float:
    """What a forward saves for backward a token and a layer: two lengths apart (which leaves out what
    a micro-batch keeps whatever its length, such as the q/k/v adapters' concatenated A)."""
    return (_kept_bytes(model, 48) - _kept_bytes(model, 16)) / 32 / layers


def _adapters_keep_what_the_estimate_counts(spec) -> None:
    """Saved tensors of a LoRA forward (fp32, every projection adapted) against the same forward with
    the adapters off and against full fine-tuning's. Without dropout the adapters keep their rank-r
    intermediates and their layers' inputs (which the frozen base linears keep no more: the estimate
    counts them as full fine-tuning's); with it, the dropped inputs and the noise instead. Full
    fine-tuning's forward and the adapters' count bound the LoRA forward from above."""
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.lora import adapters_off
    from bapo_megatron.trainer.memory.adapters import adapter_token_bytes

    def build(*overrides: str):
        cfg = load_config(None, list(overrides))
        return cfg, mc.build_gpt_model(spec, cfg.model, cfg.parallel, pre_process=True, post_process=True)

    _, full = build()
    full_finetuning = _per_token(full, spec.num_layers)
    # the inputs of q/k/v and gate/up (hidden) and of down (the MLP's width), fp32; o's is the fused
    # attention kernel's output, a view of what the kernel keeps adapted or not (models/local_attention.py)
    inputs = 4 * (2 * spec.hidden_size + spec.ffn_hidden_size)
    for dropout in (0.0, 0.1):
        cfg, model = build("model.lora.rank=4", f"model.lora.dropout={dropout}")
        with adapters_off([model]):
            off = _per_token(model, spec.num_layers)
        on = _per_token(model, spec.num_layers)
        counted = adapter_token_bytes(spec, cfg.model.lora, cfg.parallel, 0, 4, local=True)
        assert on - off == counted + (inputs if dropout == 0 else 0), (dropout, on, off, counted)
        assert on <= full_finetuning + counted, (dropout, on, full_finetuning, counted)


def test_the_lora_reference_is_the_base_with_adapters_off(tmp_path):
    run_workers(_reference_worker, 1, str(tmp_path))
