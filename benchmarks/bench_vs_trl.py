"""One RL step of this stack against TRL's GRPOTrainer, side by side on the demo's addition task.

    python benchmarks/bench_vs_trl.py [--pairs 3] [--steps 30] [--warmup 3] [--trl-python PY] [--eval-prompts 200]
    python benchmarks/bench_vs_trl.py --engine-only [--repeats 5]
    python benchmarks/bench_vs_trl.py --stacks project --steps 3 --warmup 1 --pairs 1   # the project half alone

Both stacks start from the same warm start: the demo's SFT export (examples/demo.py phases 1-2,
made under --warm, default runs/bench_vs_trl/warm, on the first run and reused: a demo run's too),
and run the same batch: 32 prompts x 8 samples, 6 new tokens, temperature 1, the same lr, one
update per batch, prompts tokenized identically (checked). The project runs `bapo-train` with
algo.loss=ppo, sync rollout on its embedded engine (a process of its own), no partial rollout;
TRL runs GRPOTrainer with loss_type="dapo" (token-mean clipped loss), beta 0, fp32, gradient
checkpointing off, in a process of its own under --trl-python (benchmarks/trl_grpo.py; TRL is an
optional benchmark extra, never a test dependency: pip install 'bapo-megatron[bench]' in a virtual
environment of its own). The runs are interleaved (project, trl, ...): a change in load hits both.

Per stack, over the steps after --warmup of every run: the median and (min-max) of the step and
its split (generation; reward: TRL's reward call, the project's wait for rewards once generation
ended, as its reward workers score samples while others generate; train: the rest of the step
but the weight sync, log-probs, loss, backward, optimizer); generated tokens per second of generation;
peak memory of all its processes summed (children included; PeakMemory) as RSS (shared pages count
once per process) and as PSS (each shared page split among the processes that map it: what they
hold together); and, with --eval-prompts, held-out greedy accuracy before and after.

--engine-only: the generation alone on the same batch, medians over --repeats interleaved
repeats: transformers' `generate` in this process, the embedded engine's core in this process
(no HTTP), and the embedded engine in its own process: one /generate call a group of samples and
one call a sample (as the async and retract modes send them). The load average is printed: figures
from a loaded machine are not figures (--threads 1 keeps torch's threads off other work).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM = ROOT / "runs" / "bench_vs_trl" / "warm"
SPLIT = ("step", "generate", "reward", "train", "sync")


def warm_start(args) -> dict[str, Path]:
    """The demo's task and SFT export under --warm (default runs/bench_vs_trl/warm): made there by the
    demo's phases 1-2 when it has none, and reused."""
    run = Path(args.warm) if args.warm else WARM
    paths = {
        "train": run / "task" / "train.jsonl",
        "heldout": run / "task" / "heldout.jsonl",
        "model": run / "task" / "model",
        "ckpt": run / "sft" / "ckpt",
        "hf": run / "sft" / "hf",
    }
    if not (paths["hf"] / "config.json").exists():
        sys.path.insert(0, str(ROOT / "examples"))
        from demo import warm_start as demo_warm_start

        demo_warm_start("addition", run, seed=0, heldout=1000, target=args.sft_target, steps=args.sft_steps)
    return paths


class PeakMemory:
    """The largest sums of RSS and of PSS over a process and all its descendants, sampled on a thread.
    RSS is read every interval_s (/proc/PID/statm: microseconds); PSS (/proc/PID/smaps_rollup walks
    every mapping under the process's memory lock: 3-5 ms a process, 9 ms a sample of the project's
    three) when the RSS sum reaches a new high, and every pss_every_s besides: read at every interval,
    it took a tenth of a core from the runs it measured."""

    def __init__(self, pid: int, interval_s: float = 0.05, pss_every_s: float = 1.0) -> None:
        self.pid, self.interval_s, self.pss_every_s, self.rss, self.pss = pid, interval_s, pss_every_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        last_pss = 0.0
        while not self._stop.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = sum(_quietly(lambda p=p: p.memory_info().rss) for p in tree)
            if rss > self.rss or time.monotonic() - last_pss >= self.pss_every_s:
                self.pss = max(self.pss, sum(_quietly(lambda p=p: _pss(p.pid)) for p in tree))
                last_pss = time.monotonic()
            self.rss = max(self.rss, rss)
            self._stop.wait(self.interval_s)


def _quietly(read) -> int:
    """read() of a process that may have ended meanwhile (0 then)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return read()
    return 0


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (Linux: /proc/PID/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def _run_measured(command: list[str], env: dict[str, str], log: Path) -> dict[str, int]:
    """Run `command` to its end (its output to `log`); the peak RSS and PSS of its process tree, in bytes."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        with PeakMemory(process.pid) as peak:
            code = process.wait()
    if code != 0:
        raise SystemExit(f"{command[:4]} failed (exit {code}); its log: {log}\n{log.read_text()[-3000:]}")
    return {"peak_rss": peak.rss, "peak_pss": peak.pss}


def run_project(warm: dict[str, Path], out: Path, args) -> dict:
    """One `bapo-train` run: its steps' split (after the warm-up), peak RSS, final export."""
    overrides = [
        f"model.hf_path={warm['model']}",
        f"model.mcore_path={warm['ckpt']}",
        f"data.path={warm['train']}",
        f"run_dir={out}",
        f"checkpoint.dir={out / 'ckpt'}",
        "checkpoint.resume=false",
        "checkpoint.interval=0",
        f"seed={args.seed}",
        f"data.seed={args.seed}",  # the prompt order: TRL's seed moves its sampler's too
        f"steps={args.steps}",
        "algo.loss=ppo",
        "algo.updates_per_batch=1",
        "rollout.mode=sync",
        "rollout.partial.enabled=false",
        "rollout.partial.token_budget=null",
        "rollout.oversample=1.0",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.sampling.max_new_tokens={args.max_new}",
        "rollout.sampling.temperature=1.0",
        "eval.path=null",
        f"optimizer.lr={args.lr}",
        "logging.backends=[jsonl]",
    ]
    command = [sys.executable, "-m", "bapo_megatron.train", str(ROOT / "examples" / "demo" / "rl.yaml"), *overrides]
    peak = _run_measured(command, {**os.environ, "PYTHONPATH": str(ROOT)}, out.with_suffix(".log"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [
        {
            "step": r["time/step"],
            "generate": r["rollout/seconds"] - r.get("rollout/reward_wait", 0.0),
            "reward": r.get("rollout/reward_wait", 0.0),
            "train": r["time/train"],
            "sync": r.get("time/weight_sync", 0.0),
            "tokens": r["rollout/tokens"],
        }
        for r in records
        if "time/step" in r
    ]
    return {"steps": steps[args.warmup :], **peak, "model": out / "ckpt"}


def run_trl(warm: dict[str, Path], out: Path, args) -> dict:
    """One GRPOTrainer run in a process of its own under --trl-python (trl_grpo.py)."""
    command = [
        args.trl_python,
        str(Path(__file__).resolve().parent / "trl_grpo.py"),
        str(out),
        *("--hf", str(warm["hf"]), "--train", str(warm["train"]), "--steps", str(args.steps)),
        *("--prompts", str(args.prompts), "--samples", str(args.samples), "--max-new", str(args.max_new)),
        *("--lr", str(args.lr), "--seed", str(args.seed)),
    ]
    peak = _run_measured(command, dict(os.environ), out.with_suffix(".log"))
    steps = json.loads((out / "steps.json").read_text())
    return {"steps": steps[args.warmup :], **peak, "model": out / "model"}


# -- the generation alone (--engine-only) ------------------------------------------------------
def engine_batch(warm: dict[str, Path], args) -> list[list[int]]:
    """The first --prompts training prompts, each --samples times, as the project tokenizes them."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(warm["hf"])
    rows = [json.loads(line) for line in warm["train"].read_text().splitlines()[: args.prompts]]
    return [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows for _ in range(args.samples)]


def _kept(row: list[int], eos: set[int]) -> int:
    """Tokens a response keeps: up to and including its first stop token."""
    return next((i + 1 for i, t in enumerate(row) if t in eos), len(row))


def hf_generate(model, batch: list[list[int]], max_new: int, eos: set[int]) -> int:
    """transformers' `generate` on the batch (left-padded), sampled at temperature 1; tokens kept."""
    import torch

    longest = max(len(ids) for ids in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(batch):
        ids[b, longest - len(row) :], mask[b, longest - len(row) :] = torch.tensor(row), 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": max_new},
            **{"eos_token_id": sorted(eos), "pad_token_id": model.config.pad_token_id},
        )
    return sum(_kept(row, eos) for row in out[:, longest:].tolist())


def engine_core(core, batch: list[list[int]], max_new: int, tag: str) -> int:
    """The embedded engine's core in this process, stepped until the batch is done; tokens made."""
    from bapo_megatron.common.protocol import SamplingParams
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    for i, ids in enumerate(batch):
        core.add(EngineRequest(f"{tag}-{i}", list(ids), sampling))
    tokens = 0
    while core.busy:
        tokens += sum(len(r.output_ids) for r in core.step())
    return tokens


class HttpEngine:
    """The embedded engine as the project runs it: its own process, over one client kept open (its
    connections too) between batches, as the rollout's is; one /generate call a group of `group`
    samples (SGLang's batch form, as a sync rollout sends them), or one a sample (group 1)."""

    def __init__(self, url: str, group: int) -> None:
        import asyncio

        from bapo_megatron.engines.client import EngineClient

        self.loop = asyncio.new_event_loop()
        self.client, self.group = EngineClient(url), group

    def __call__(self, batch: list[list[int]], max_new: int, tag: str) -> int:
        import asyncio

        from bapo_megatron.common.protocol import SamplingParams

        sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0)

        def together(i: int) -> int | None:
            return i // self.group if self.group > 1 else None

        async def run() -> list:
            return await asyncio.gather(
                *(
                    self.client.generate(ids, sampling, f"{tag}-{i}", together=together(i))
                    for i, ids in enumerate(batch)
                )
            )

        answers = self.loop.run_until_complete(run())
        return sum(len(a.output_ids) for a in answers)

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def engine_only(warm: dict[str, Path], args) -> dict[str, dict]:
    """Seconds and tokens/s of each generator on the same batch, the repeats interleaved."""
    import torch
    import transformers

    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.weights import eos_ids
    from bapo_megatron.engines.launcher import embedded_server

    batch = engine_batch(warm, args)
    model = transformers.AutoModelForCausalLM.from_pretrained(warm["hf"], dtype=torch.float32).eval()
    eos = set(eos_ids(model))
    core = EngineCore(warm["hf"], seed=args.seed, max_batch=len(batch))
    log = Path(args.out) / "engine.log"
    server = embedded_server(warm["hf"], log, seed=args.seed, max_batch=len(batch)).start().wait_ready(300)
    by_sample, by_group = HttpEngine(server.url, 1), HttpEngine(server.url, args.samples)
    runs = {
        "transformers generate": lambda i: hf_generate(model, batch, args.max_new, eos),
        "engine core (in process)": lambda i: engine_core(core, batch, args.max_new, f"c{i}"),
        "engine over HTTP, a call a group": lambda i: by_group(batch, args.max_new, f"g{i}"),
        "engine over HTTP, a call a sample": lambda i: by_sample(batch, args.max_new, f"s{i}"),
    }
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in runs}
    try:
        for i in range(-1, args.repeats):  # -1: an untimed warm-up of each
            for name, fn in runs.items():
                start = time.perf_counter()
                tokens = fn(i)
                if i >= 0:
                    results[name].append((time.perf_counter() - start, tokens))
    finally:
        by_sample.close()
        by_group.close()
        server.stop()
    return {name: _rates(r) for name, r in results.items()}


def _rates(timings: list[tuple[float, int]]) -> dict:
    seconds = [s for s, _ in timings]
    rates = [t / s for s, t in timings]
    return {
        "seconds": statistics.median(seconds),
        "seconds_range": [min(seconds), max(seconds)],
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_range": [min(rates), max(rates)],
    }


# -- the side by side -------------------------------------------------------------------------
def accuracy(model_dir: Path, warm: dict[str, Path], args) -> float:
    """Held-out greedy accuracy; a project checkpoint is exported to HF format first (demo's phase 4)."""
    from bapo_megatron.evaluate import evaluate_hf

    if model_dir.name == "ckpt":
        sys.path.insert(0, str(ROOT / "examples"))
        from demo import export

        export(model_dir, warm["model"], model_dir.parent / "hf")
        model_dir = model_dir.parent / "hf"
    scores = evaluate_hf(model_dir, warm["heldout"], samples=1, max_prompts=args.eval_prompts, seed=args.seed)
    return scores["greedy_acc"]


def summary(runs: list[dict]) -> dict:
    """A stack's figures over its runs: medians and (min, max) of the split, tokens/s, peak RSS and PSS, gains."""
    rows = [s for r in runs for s in r["steps"]]
    out = {"steps": len(rows)}
    for name in SPLIT:
        values = [s[name] for s in rows]
        out[name], out[f"{name}_range"] = statistics.median(values), [min(values), max(values)]
    rates = [s["tokens"] / s["generate"] for s in rows if s["generate"] > 0]
    out["tokens_per_s"], out["tokens_per_s_range"] = statistics.median(rates), [min(rates), max(rates)]
    for kind in ("rss", "pss"):
        peaks = [r[f"peak_{kind}"] / 2**30 for r in runs]
        out[f"peak_{kind}_gib"], out[f"peak_{kind}_gib_range"] = statistics.median(peaks), [min(peaks), max(peaks)]
    gains = [r["accuracy"] for r in runs if "accuracy" in r]
    if gains:
        out["accuracy_after"], out["accuracy_after_range"] = statistics.median(gains), [min(gains), max(gains)]
        out["accuracy_mean"] = statistics.fmean(gains)
        # the pairs run seeds seed..seed+pairs-1: their spread is the runs', one seed's draw swings ~5 points
        out["accuracy_sem"] = statistics.stdev(gains) / len(gains) ** 0.5 if len(gains) > 1 else None
    return out


def _cell(value: float, bounds: list[float], fmt: str = ".3f") -> str:
    return f"{value:{fmt}}({bounds[0]:{fmt}}-{bounds[1]:{fmt}})"


def print_table(results: dict[str, dict], args, load: tuple[float, float]) -> None:
    print(
        f"addition task, {args.prompts} prompts x {args.samples} samples, {args.max_new} new tokens, lr {args.lr}; "
        f"{args.pairs} interleaved pair(s) of {args.steps} steps ({args.warmup} warm-up); "
        f"{os.cpu_count()} CPU cores, load average {load[0]:.2f} before, {load[1]:.2f} after"
    )
    print("seconds per step: median(min-max) over the steps after warm-up; peak RSS and PSS of all processes, GiB")
    header = ["stack", *SPLIT, "gen tok/s", "peak RSS", "peak PSS", "acc after"]
    print("  ".join(f"{h:>22}" if i else f"{h:>8}" for i, h in enumerate(header)))
    print("-" * (8 + 24 * (len(header) - 1)))
    for stack, r in results.items():
        if not isinstance(r, dict) or "step" not in r:
            continue
        cells = [stack, *(_cell(r[n], r[f"{n}_range"]) for n in SPLIT)]
        cells.append(_cell(r["tokens_per_s"], r["tokens_per_s_range"], ".0f"))
        cells.append(_cell(r["peak_rss_gib"], r["peak_rss_gib_range"], ".2f"))
        cells.append(_cell(r["peak_pss_gib"], r["peak_pss_gib_range"], ".2f"))
        cells.append(_cell(r["accuracy_after"], r["accuracy_after_range"]) if "accuracy_after" in r else "-")
        print("  ".join(f"{c:>22}" if i else f"{c:>8}" for i, c in enumerate(cells)))
    if "project" in results and "trl" in results:
        p, t = results["project"], results["trl"]
        print(
            f"vs TRL: step {p['step'] / t['step']:.2f}x, generation {p['generate'] / t['generate']:.2f}x, "
            f"train {p['train'] / t['train']:.2f}x, peak RSS {p['peak_rss_gib'] / t['peak_rss_gib']:.2f}x, "
            f"peak PSS {p['peak_pss_gib'] / t['peak_pss_gib']:.2f}x"
        )
    for stack, r in results.items():
        if isinstance(r, dict) and r.get("accuracy_sem") is not None:
            mean, sem = r["accuracy_mean"], r["accuracy_sem"]
            print(
                f"{stack}: held-out accuracy after, mean over the pairs' seeds {mean:.3f} +- {sem:.3f} (standard error)"
            )
    if "accuracy_before" in results:
        print(f"held-out greedy accuracy of the warm start: {results['accuracy_before']:.3f}")


def print_engine_table(results: dict[str, dict], args, load: tuple[float, float]) -> None:
    print(
        f"generation alone: {args.prompts} prompts x {args.samples} samples, {args.max_new} new tokens, "
        f"temperature 1; {args.repeats} interleaved repeats; torch threads {_threads()}; "
        f"load average {load[0]:.2f} before, {load[1]:.2f} after"
    )
    print(f"{'generator':>33}  {'seconds':>22}  {'tokens/s':>22}  {'vs generate':>11}")
    print("-" * 95)
    base = results["transformers generate"]["tokens_per_s"]
    for name, r in results.items():
        seconds, rate = (
            _cell(r["seconds"], r["seconds_range"]),
            _cell(r["tokens_per_s"], r["tokens_per_s_range"], ".0f"),
        )
        print(f"{name:>33}  {seconds:>22}  {rate:>22}  {r['tokens_per_s'] / base:>10.2f}x")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def side_by_side(warm: dict[str, Path], args) -> dict:
    """The stacks' runs interleaved, pair by pair; their summaries (and the warm start's accuracy)."""
    runners = {"project": run_project, "trl": run_trl}
    runs: dict[str, list[dict]] = {stack: [] for stack in args.stacks}
    for pair in range(args.pairs):
        # each pair its own seed, the same in both stacks: one seed's prompts and samples decide
        # a run's accuracy (0.40 to 0.60 over seeds), so repeats of one seed would show no spread
        seeded = argparse.Namespace(**{**vars(args), "seed": args.seed + pair})
        for stack in args.stacks:
            out = Path(args.out) / f"{stack}-{pair}"
            result = runners[stack](warm, out, seeded)
            if args.eval_prompts:
                result["accuracy"] = accuracy(result["model"], warm, args)
            runs[stack].append(result)
            step = statistics.median(s["step"] for s in result["steps"])
            print(f"{stack} run {pair}: median step {step:.3f} s", flush=True)
    results: dict = {stack: summary(r) for stack, r in runs.items()}
    if args.eval_prompts:
        results["accuracy_before"] = accuracy(warm["hf"], warm, args)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", help="a demo run's directory (task/, sft/ckpt, sft/hf), made when it has none")
    parser.add_argument("--sft-target", type=float, default=0.4, help="the warm start's, when it is made")
    parser.add_argument("--sft-steps", type=int, default=None, help="the warm start's at most, when it is made")
    parser.add_argument("--stacks", nargs="+", choices=["project", "trl"], default=["project", "trl"])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-4, help="the demo's (examples/demo/rl.yaml)")
    parser.add_argument("--seed", type=int, default=0, help="pair i runs seed SEED+i in both stacks")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts scored (0: none)")
    parser.add_argument("--trl-python", default=sys.executable, help="a Python with trl installed")
    parser.add_argument("--engine-only", action="store_true", help="the generation alone (see above)")
    parser.add_argument("--repeats", type=int, default=5, help="--engine-only's")
    parser.add_argument("--threads", type=int, help="torch threads of every process (default: torch's, the cores)")
    parser.add_argument("--out", help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if "trl" in args.stacks and not args.engine_only:
        check = subprocess.run([args.trl_python, "-c", "import trl"], capture_output=True, text=True)
        if check.returncode:
            raise SystemExit(f"--trl-python {args.trl_python}: cannot import trl (pip install 'bapo-megatron[bench]')")
    import tempfile

    if args.threads:  # every process of both stacks inherits it (the engine-only generators run here)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        import torch

        torch.set_num_threads(args.threads)
    args.out = args.out or tempfile.mkdtemp(prefix="bench_vs_trl_")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    warm = warm_start(args)
    load_before = os.getloadavg()
    results = engine_only(warm, args) if args.engine_only else side_by_side(warm, args)
    load = (load_before[0], os.getloadavg()[0])
    (print_engine_table if args.engine_only else print_table)(results, args, load)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
