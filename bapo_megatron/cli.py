"""The `bapo-train` command line: arguments, --help-config (from the config dataclasses) and --dry-run.

    bapo-train CONFIG.yaml [key=value ...]          # same as python -m bapo_megatron.train
    bapo-train --help-config                        # every field: type, default, what it does
    bapo-train CONFIG.yaml --dry-run [key=value]    # resolved config, layout, engines, memory; builds nothing

The field list is generated from the dataclasses and their field docstrings, never kept by
hand. The dry run's memory figures come from trainer/memory.py (exact parameter counts, the
rest estimated) and need neither a GPU nor Megatron.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re
import textwrap
import typing

from bapo_megatron.config import JobConfig, ParallelConfig, RolloutConfig, dump_config

if typing.TYPE_CHECKING:
    from bapo_megatron.common.model_spec import ModelSpec

USAGE = "bapo-train [CONFIG.yaml] [key=value ...] [--dry-run] [--world-size N] [--gpu-memory-gib G]"
GIB = 2**30


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bapo-train",
        usage=USAGE,
        description="BAPO reinforcement learning on Megatron-Core: rollout, rewards, policy update, weight sync.",
        epilog="Overrides are dotted config fields (algo.bapo.target_rho=0.4); --help-config lists them all. "
        "torchrun and srun start the same command on every rank.",
    )
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value", help="a YAML file, then overrides")
    parser.add_argument("--help-config", action="store_true", help="list every config field and exit")
    parser.add_argument("--dry-run", action="store_true", help="print what would run and the memory it needs; exit")
    parser.add_argument(
        "--world-size", type=int, help="trainer processes for --dry-run (default: $WORLD_SIZE, else one)"
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU size for --dry-run (default 80: H100)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs of the driver's node for --dry-run (default 8)"
    )
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    args.config = args.args[0] if args.args and "=" not in args.args[0] else None
    args.overrides = args.args[1:] if args.config else args.args
    bad = [a for a in args.overrides if "=" not in a]
    if bad:
        parser.error(f"{bad[0]!r} is neither the config file (first) nor a key=value override")
    return args


# ----------------------------------------------------------------------------------------------
# --help-config


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), inherited ones too."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, following in zip(body, [*body[1:], None], strict=True):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = (
                    following.value.value
                    if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    else ""
                )
                docs[node.target.id] = " ".join(str(doc).split())
    return docs


def _type_name(hint) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    return text if "[" in text or "|" in text else getattr(hint, "__name__", text)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(section)" if dataclasses.is_dataclass(value) else repr(value)
    return "(required)"


def config_fields(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) of every field, sections expanded."""
    hints, docs, rows = typing.get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        name, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += config_fields(hint, name + ".")
        else:
            rows.append((name, _type_name(hint), _default(f), docs.get(f.name, "")))
    return rows


def help_config() -> str:
    lines = ["Every field (dotted name, type, default), settable in the YAML file or as key=value:", ""]
    for name, type_name, default, doc in config_fields():
        lines.append(f"{name}: {type_name} = {default}")
        if doc:
            lines.extend("    " + line for line in textwrap.wrap(doc, 96))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --dry-run


def dry_run(cfg: JobConfig, world_size: int, gpu_bytes: int, gpus_per_node: int = 8) -> str:
    """What `bapo-train` would do with `cfg` on `world_size` trainer processes (one a GPU, nodes of
    gpus_per_node), without doing it."""
    from bapo_megatron.common.model_spec import check_layout
    from bapo_megatron.preflight import model_spec, validate
    from bapo_megatron.trainer.memory import trainer_memory

    spec = model_spec(cfg)
    p = cfg.parallel
    check_layout(spec, p.tensor, p.pipeline, p.virtual_pipeline, p.expert, p.sequence_parallel)
    dp = p.data_parallel_size(world_size)
    if cfg.rollout.replay is not None:
        validate(cfg, spec, world_size)
    r = cfg.rollout
    samples = r.prompts_per_step * r.samples_per_prompt // cfg.algo.updates_per_batch
    longest = r.sampling.max_new_tokens + 512  # a prompt of up to 512 tokens: micro-batches to expect
    per_mb = max(1, p.max_tokens_per_microbatch // longest)
    out = ["# resolved config", dump_config(cfg).rstrip(), "", "# layout"]
    out.append(
        f"trainer: {world_size} processes = TP {p.tensor} x PP {p.pipeline} x VPP {p.virtual_pipeline or 1} "
        f"(virtual stages) x CP {p.context} x DP {dp}"
    )
    out.append(
        f"per optimizer step: {samples} samples, {math.ceil(samples / dp)} per data-parallel rank, about "
        f"{math.ceil(samples / dp / per_mb)} micro-batches of <= {p.max_tokens_per_microbatch} tokens "
        f"(responses up to {r.sampling.max_new_tokens} tokens); {cfg.algo.updates_per_batch} steps per batch"
    )
    if spec.moe is not None:
        out.append(_experts_layout(spec, p, dp))
    if p.recompute != "none":
        from bapo_megatron.trainer.memory import recomputed_layers

        rerun = len(recomputed_layers(spec, p, 0))
        what = "core attention of every layer" if p.recompute == "selective" else f"{rerun} layers a pipeline rank"
        out.append(f"activation recompute: {p.recompute}, {what} run again in the backward pass")
    if r.replay is not None:
        out.append(f"rollout: replayed batches from {r.replay} (no engine)")
    else:
        out.append(_schedule(r))
        e = r.engines
        where = "colocated with the trainer" if e.colocate else f"on GPUs of their own, listening on {e.host}"
        if e.urls:
            out.append(f"engines: {len(e.urls)} running elsewhere: {', '.join(e.urls)}")
        else:
            out.append(
                f"engines: {e.servers} {e.kind} server(s), TP {e.tensor_parallel} each, ports {e.port}.."
                f"{e.port + e.servers - 1}, {where}"
            )
        if e.kind == "sglang" and not e.urls:
            out.append(_sglang_placement(r, min(world_size, gpus_per_node), gpus_per_node))
    out += ["", f"# memory per GPU (estimate; GPU of {gpu_bytes / GIB:.0f} GiB)"]
    for label, distributed in (("distributed optimizer", True), ("replicated optimizer", False)):
        m = trainer_memory(spec, cfg.model, p, dp, distributed_optimizer=distributed)
        out.append(
            f"trainer, {label}: parameters {m.params / GIB:.2f} GiB, gradients {m.grads / GIB:.2f} GiB, "
            f"optimizer {m.optimizer / GIB:.2f} GiB, activations of one micro-batch {m.activations / GIB:.2f} "
            f"GiB; peak {m.peak / GIB:.2f} GiB"
        )
    if spec.moe is not None:
        out += _moe_memory(cfg, spec, dp)
    if r.replay is None and r.engines.kind == "sglang":
        out.append(_sglang_memory(cfg, spec, gpu_bytes, dp))
    return "\n".join(out)


def _experts_layout(spec: ModelSpec, p: ParallelConfig, dp: int) -> str:
    """Where a mixture-of-experts model's experts live, in one line."""
    moe = spec.moe
    return (
        f"experts: {moe.num_experts} a layer in {len(moe.sparse_layers)} of {spec.num_layers} layers, "
        f"top-{moe.top_k}; EP {p.expert}: {moe.num_experts // p.expert} whole experts on each rank (expert TP 1), "
        f"their optimizer state sharded over expert data parallel {p.tensor * dp // p.expert} (the rest over DP {dp})"
    )


def _moe_memory(cfg: JobConfig, spec: ModelSpec, dp: int) -> list[str]:
    """The experts' share of a trainer GPU, and the routes a step stores for routing replay."""
    from bapo_megatron.trainer.memory import routing_replay_bytes, trainer_memory

    moe, r = spec.moe, cfg.rollout
    experts = trainer_memory(spec, cfg.model, cfg.parallel, dp, distributed_optimizer=True).experts
    layers, index = len(moe.sparse_layers), 1 if moe.num_experts <= 256 else 2
    prompt = cfg.data.max_prompt_tokens or 512  # as the micro-batch count above, when prompts are not capped
    tokens = r.prompts_per_step * r.samples_per_prompt * (prompt + r.sampling.max_new_tokens)
    replay = routing_replay_bytes(spec, tokens)
    steps = r.max_staleness + 1  # async: the groups queued or generating, (K + 1) steps' worth
    queued = (
        f"; async, {steps} steps' worth queued or generating: {steps * replay / GIB:.2f} GiB"
        if r.mode == "async"
        else ""
    )
    return [
        f"experts on a trainer GPU (distributed optimizer): parameters, gradients and optimizer state "
        f"{experts / GIB:.2f} GiB of the above",
        f"routing replay (R3): {layers} MoE layers x top-{moe.top_k} x {index} byte{'s' if index > 1 else ''} = "
        f"{layers * moe.top_k * index} B a token; a step's {r.prompts_per_step} prompts x {r.samples_per_prompt} "
        f"samples x ({prompt} prompt + {r.sampling.max_new_tokens} new) tokens = {tokens:,} tokens: "
        f"{replay / GIB:.2f} GiB{queued}",
    ]


def _schedule(r: RolloutConfig) -> str:
    """How generation runs against training, in one line."""
    k = r.max_staleness
    bound = f"no token more than {k} version(s) older than the policy it trains" + (
        " (older ones masked out of the loss)" if r.mask_stale_prefix else " (older samples generated again)"
    )
    if r.mode == "async":
        queued, generating = (k + 1) * r.prompts_per_step, math.ceil(r.prompts_per_step * r.oversample)
        return (
            f"rollout: mode async, max_staleness K={k}: the engines generate while the trainer trains; at most "
            f"{queued} groups queued or generating, {generating} generating; weight updates pause them "
            f"({r.pause_mode}); {bound}"
        )
    how = (
        "deterministic rounds"
        if r.deterministic
        else (
            f"partial rollout ({r.partial.mode}, {r.token_budget} tokens a request)"
            if r.partial.enabled
            else "whole responses"
        )
    )
    return f"rollout: mode sync, max_staleness K={k}: each step generates, then trains; {how}; {bound}"


def _sglang_placement(r: RolloutConfig, trainer_gpus: int, node_gpus: int) -> str:
    from bapo_megatron.engines.sglang_launcher import gpu_placement

    try:
        bases = gpu_placement(r, trainer_gpus, node_gpus)
    except ValueError as err:
        return f"SGLang servers on the driver's node: cannot place them ({err})"
    tp = r.engines.tensor_parallel
    gpus = ", ".join(f"{b}" if tp == 1 else f"{b}-{b + tp - 1}" for b in bases)
    return (
        f"SGLang servers on the driver's node ({node_gpus} GPUs, trainer ranks on GPUs 0-{trainer_gpus - 1}): "
        f"GPUs {gpus}"
    )


def _sglang_memory(cfg: JobConfig, spec, gpu_bytes: int, dp: int) -> str:
    from bapo_megatron.engines.sglang_launcher import mem_fraction
    from bapo_megatron.trainer.memory import rollout_mem_fraction, stage_params

    e = cfg.rollout.engines
    # bf16 weights of one server rank: the whole model at TP = the server's, one stage, no vocabulary
    # padding; SGLang splits each expert over its TP ranks, the same bytes as EP = TP whole experts
    weights = stage_params(spec, spec.vocab_size, e.tensor_parallel, 1, 0, expert=e.tensor_parallel) * 2
    try:
        colocated = rollout_mem_fraction(cfg, spec, gpu_bytes, dp) if e.colocate else None
        fraction = mem_fraction(cfg.rollout, colocated)
    except ValueError as err:
        return f"each SGLang server GPU: cannot fit ({err})"
    kv_budget = max(0, int(fraction * gpu_bytes) - weights)
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 // e.tensor_parallel  # keys+values, bf16
    return (
        f"each SGLang server GPU: mem_fraction_static {fraction:.2f}: weights {weights / GIB:.2f} GiB, "
        f"KV cache {kv_budget / GIB:.2f} GiB = {kv_budget // max(per_token, 1):,} tokens"
    )


def world_size(args: argparse.Namespace, cfg: JobConfig | None = None) -> tuple[int, str | None]:
    """The trainer processes a dry run plans for, and how that number was chosen when no one gave
    it: --world-size, else $WORLD_SIZE (a launcher's), else the Slurm script of this repository
    that runs the config (its trainer nodes x --gpus-per-node), else the smallest world the config's
    parallel sizes need (TP x PP x CP)."""
    if args.world_size:
        return args.world_size, None
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), None
    if cfg is None:
        return 1, None
    script = slurm_world(args.config) if args.config else None
    if script is not None:
        size, path = script
        return size, f"no --world-size: planned for {size} trainer processes, as {path} runs this config"
    p = cfg.parallel
    size = p.tensor * p.pipeline * p.context
    if size == 1:
        return 1, None
    return size, (
        f"no --world-size: planned for the smallest world the layout needs, TP {p.tensor} x PP {p.pipeline} x "
        f"CP {p.context} = {size} trainer processes (data parallel 1); --world-size N plans another"
    )


SLURM_CONFIG = re.compile(r"^CONFIG=\$\{CONFIG:-(\S+?)\}", re.M)
SLURM_JOB = re.compile(r"^bapo_gpu_job\s+(\d+)\b", re.M)
SLURM_GPUS = re.compile(r"^#SBATCH\s+--gpus-per-node=(\d+)", re.M)


def slurm_world(config: str) -> tuple[int, str] | None:
    """(trainer processes, script) of the slurm/*.sh script in this checkout whose default CONFIG
    is `config`: its bapo_gpu_job trainer nodes x #SBATCH --gpus-per-node; None when none is."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    target = Path(config).resolve()
    for script in sorted((root / "slurm").glob("*.sh")):
        text = script.read_text()
        found, job, gpus = SLURM_CONFIG.search(text), SLURM_JOB.search(text), SLURM_GPUS.search(text)
        if found and job and gpus and (root / found.group(1)).resolve() == target:
            return int(job.group(1)) * int(gpus.group(1)), f"slurm/{script.name}"
    return None
