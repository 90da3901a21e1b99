"""The trainer's memory estimate (trainer/memory/estimate.py) against a CPU step's measured memory, term by term.

    python benchmarks/bench_memory.py                   # the table of benchmarks/RESULTS.md
    python benchmarks/bench_memory.py --quick --seq 128  # smoke run (tests/e2e/test_benchmarks.py)

Each layout runs on its own gloo processes (TP2: two, PP2: two): for every sequence length and
recompute setting, the real trainer (Megatron-Core, the local layer spec, the CPU shim, fp32) of a
tiny model takes two optimizer steps on two samples of exactly --seq tokens, one micro-batch each,
and trainer/memory/probe.py measures the second: the parameters, DDP's gradient buffer, Adam's
state, and the most bytes of tensors alive at once during the step beyond those (activations).
Estimates are estimate.stage_memory's for the same config on one data-parallel rank (no distributed
optimizer on CPU), a row per pipeline stage (tensor-parallel rank 0). Goal: activations and peak
within 20% (ratio = measured / estimate).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "TP1": [],
    "TP2": ["parallel.tensor=2"],
    "TP2+SP": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    "PP2": ["parallel.pipeline=2"],
    "TP2+SP+EP2": ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2"],
}
RECOMPUTE = {
    "none": [],
    "selective": ["parallel.recompute=selective"],
    "full": ["parallel.recompute=full"],
    "full/1": ["parallel.recompute=full", "parallel.recompute_layers=1"],
}
MODELS = {"dense": "qwen2", "moe": "qwen3_moe", "hybrid": "qwen3_5_text", "mla": "deepseek_v3"}
"""tiny_spec's architectures: Qwen2 (4 layers, GQA 4/2, vocab 250 padded to 1024), Qwen3-MoE (4
experts, top-2, q/k norms), Qwen3.5 (3 Gated DeltaNet layers, the torch delta rule, and a gated full
attention one), DeepSeek-V3 (multi-latent attention, routed experts)."""
TERMS = ("params", "grads", "optimizer", "activations", "peak")
MIB = 2**20


def plan(seqs: list[int], quick: bool) -> list[tuple[str, str, list[tuple[int, str]]]]:
    """(model, layout, [(seq, recompute)]) to measure: the dense model on one process at every length
    and setting; at the middle length the other layouts, each with recompute and without, and the
    MoE model (at TP 2 a MoE layer needs sequence parallel; EP 2 splits its experts)."""
    if quick:
        return [("dense", "TP1", [(s, r) for s in seqs for r in ("none", "full")])]
    mid = sorted(seqs)[len(seqs) // 2]
    return [
        ("dense", "TP1", [(s, r) for s in seqs for r in RECOMPUTE]),
        ("dense", "TP2", [(mid, "none"), (mid, "full")]),
        ("dense", "TP2+SP", [(mid, "none"), (mid, "selective")]),
        ("dense", "PP2", [(mid, "none"), (mid, "full/1")]),
        ("moe", "TP1", [(mid, "none"), (mid, "full")]),
        ("moe", "TP2+SP+EP2", [(mid, "none")]),
        ("hybrid", "TP1", [(mid, "none")]),
        ("mla", "TP1", [(mid, "none")]),
    ]


def overrides(layout: str, recompute: str, seq: int) -> list[str]:
    return [f"parallel.max_tokens_per_microbatch={seq}", *LAYOUTS[layout], *RECOMPUTE[recompute]]


def _worker(rank: int, world: int, model: str, layout: str, runs: list, out: str) -> None:
    import gc

    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.memory.probe import fixed_batch, measure_step
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    spec, info, rows = tiny_spec(MODELS[model]), None, []
    for seq, recompute in runs:
        cfg = load_config(None, overrides(layout, recompute, seq))
        info = info or init_model_parallel(cfg.parallel, cfg.seed)
        trainer = PolicyTrainer(spec, cfg, info)
        measured = measure_step(trainer, fixed_batch(spec.vocab_size, seq))
        rows.append(
            {"seq": seq, "recompute": recompute, "stage": info.pp_rank, **{t: getattr(measured, t) for t in TERMS}}
        )
        del trainer
        gc.collect()
    if info.tp_rank == 0:
        Path(out, f"{rank}.json").write_text(json.dumps(rows))


def estimate(model: str, layout: str, recompute: str, seq: int, stage: int) -> dict[str, int]:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.memory.estimate import stage_memory

    cfg = load_config(None, overrides(layout, recompute, seq))
    e = stage_memory(tiny_spec(MODELS[model]), cfg.model, cfg.parallel, 1, stage, distributed_optimizer=False)
    return {t: getattr(e, t) for t in TERMS}


def measure(model: str, layout: str, runs: list[tuple[int, str]]) -> list[dict]:
    """The measured rows of `runs` ((seq, recompute) pairs) for one model and layout (a row per
    pipeline stage), each with its estimate."""
    from tests.dist.launch import run_workers

    world = 2 if layout != "TP1" else 1
    with tempfile.TemporaryDirectory() as tmp:
        run_workers(_worker, world, model, layout, runs, tmp)
        rows = [r for f in sorted(Path(tmp).glob("*.json")) for r in json.loads(f.read_text())]
    for r in rows:
        r.update(model=model, layout=layout, estimate=estimate(model, layout, r["recompute"], r["seq"], r["stage"]))
    return sorted(rows, key=lambda r: (r["seq"], list(RECOMPUTE).index(r["recompute"]), r["stage"]))


def table(rows: list[dict]) -> str:
    """Estimate and measurement of each term in MiB, and their ratio for activations and peak."""
    labels = dict(zip(TERMS, ("params", "grads", "optim", "act", "peak"), strict=True))
    head = f"{'model':>6} {'layout':>10} {'recompute':>9} {'seq':>5} {'stage':>5}"
    head += "".join(f" {labels[t] + ' est':>10} {'meas':>8}" for t in TERMS[:3])
    head += "".join(f" {labels[t] + ' est':>10} {'meas':>8} {'ratio':>6}" for t in TERMS[3:])
    lines = [head, "-" * len(head)]
    for r in rows:
        est = r["estimate"]
        line = f"{r['model']:>6} {r['layout']:>10} {r['recompute']:>9} {r['seq']:>5} {r['stage']:>5}"
        line += "".join(f" {est[t] / MIB:>10.2f} {r[t] / MIB:>8.2f}" for t in TERMS[:3])
        line += "".join(f" {est[t] / MIB:>10.2f} {r[t] / MIB:>8.2f} {r[t] / est[t]:>6.2f}" for t in TERMS[3:])
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048], help="tokens per micro-batch")
    parser.add_argument("--quick", action="store_true", help="the dense model on one process, recompute none and full")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    start = time.perf_counter()
    rows = []
    for model, layout, runs in plan(args.seq, args.quick):
        rows += measure(model, layout, runs)
    print(
        f"tiny models on the CPU (fp32, local layers, gloo), one micro-batch of `seq` tokens each, MiB; "
        f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after, {time.perf_counter() - start:.0f} s"
    )
    worst = max(abs(r[t] / r["estimate"][t] - 1) for r in rows for t in ("activations", "peak"))
    print(f"ratio = measured / estimate; the farthest from 1 of activations and peak: {worst:.1%} (goal 20%)")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
