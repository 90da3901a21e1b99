"""BAPO through NeMo-Run: the job defined once (`recipe`), run by the executor a flag names.

    python examples/launch_nemo_run.py --executor local [key=value ...]      # the tiny CPU job, here
    python examples/launch_nemo_run.py --executor slurm --preset qwen2.5-32b --nodes 4 \\
        --account ACCOUNT --partition PARTITION --container-image IMAGE --model-dir DIR --data FILE
    python examples/launch_nemo_run.py --executor docker --preset qwen2.5-7b --container-image IMAGE \\
        --model-dir DIR --data FILE
    ... --dryrun                                                            # print the job, submit nothing

Executors:
  local   `bapo-train` in this environment, one process (the embedded CPU engine; default preset: tiny).
  slurm   one srun task per GPU (bapo-train reads Slurm's task variables; the batch script exports the
          rendezvous), in the container when one is named. The engines share the trainer's GPUs
          (rollout.engines.colocate=true, so rollout.mode=sync): NeMo-Run's Slurm jobs have one group
          of nodes; engines on nodes of their own (asynchronous, the presets' mode) are slurm/bapo_*.sh's layout.
  docker  one node: torchrun over the GPUs of `docker run --gpus all --ipc=host`, colocated engines.
The submitted command is the same everywhere: python -m bapo_megatron.train PRESET [key=value ...].
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "tiny": ROOT / "examples" / "tiny_online.yaml",
    "qwen2.5-7b": ROOT / "examples" / "qwen2.5-7b" / "config.yaml",
    "qwen2.5-32b": ROOT / "examples" / "qwen2.5-32b" / "config.yaml",
}
GPUS_PER_NODE = 8
IMAGE_ROOT = "/opt/bapo-megatron"  # the Dockerfile's copy of the checkout
# the first node of the job and a port that differs between jobs: bapo-train's rendezvous under srun
SLURM_RENDEZVOUS = [
    'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
    "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
]


def recipe(
    preset: str, overrides: list[str], *, root: Path = ROOT, model_dir: str | None = None, data: str | None = None
):
    """The job: `python -m bapo_megatron.train PRESET [key=value ...]`, as a NeMo-Run script; `root`:
    where the checkout is for the job (the image's copy, /opt/bapo-megatron, in a container)."""
    import nemo_run as run

    args = [str(root / PRESETS[preset].relative_to(ROOT)), *anchored_paths(PRESETS[preset], root), *overrides]
    if model_dir:
        args.append(f"model.hf_path={model_dir}")
    if data:
        args.append(f"data.path={data}")
    return run.Script(path="bapo_megatron.train", m=True, entrypoint="python", args=args, env={"PYTHONUNBUFFERED": "1"})


def anchored_paths(preset: Path, root: Path) -> list[str]:
    """Overrides that make the preset's checkout-relative paths absolute under `root`: NeMo-Run starts
    the job in a directory of its own, where `examples/...` would not resolve."""
    from bapo_megatron.config import load_config

    cfg = load_config(preset)
    fields = {"model.hf_path": cfg.model.hf_path, "data.path": cfg.data.path, "eval.path": cfg.eval.path}
    if cfg.reward.function.rpartition(":")[0].endswith(".py"):  # a reward function from a file
        fields["reward.function"] = cfg.reward.function
    anchored = []
    for key, value in fields.items():
        if value and not Path(value).is_absolute() and (ROOT / value.split(":")[0]).exists():
            anchored.append(f"{key}={root / value}")
    return anchored


def executor(kind: str, opts: argparse.Namespace):
    import nemo_run as run

    if kind == "local":
        return run.LocalExecutor(ntasks_per_node=1)
    if kind == "slurm":
        tunnel = (
            run.SSHTunnel(host=opts.ssh_host, user=opts.ssh_user, job_dir=opts.job_dir)
            if opts.ssh_host
            else run.LocalTunnel(job_dir=opts.job_dir)
        )
        return run.SlurmExecutor(
            account=opts.account,
            partition=opts.partition,
            nodes=opts.nodes,
            ntasks_per_node=GPUS_PER_NODE,
            gpus_per_node=GPUS_PER_NODE,
            exclusive=True,
            time=opts.time,
            container_image=opts.container_image,
            container_mounts=opts.mount,
            setup_lines="\n".join(SLURM_RENDEZVOUS),
            env_vars={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
            packager=run.Packager(),  # nothing to ship: the image (or the shared checkout) has the code
            tunnel=tunnel,
        )
    if kind == "docker":
        if not opts.container_image:
            raise SystemExit("--executor docker needs --container-image")
        return run.DockerExecutor(
            container_image=opts.container_image,
            num_gpus=-1,
            runtime="nvidia",
            ipc_mode="host",
            shm_size="16g",
            ntasks_per_node=GPUS_PER_NODE,
            volumes=opts.mount,
            env_vars={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
            packager=run.Packager(),
            launcher="torchrun",
        )
    raise SystemExit(f"--executor {kind}: expected local, slurm or docker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for bapo-train")
    parser.add_argument("--executor", choices=["local", "slurm", "docker"], default="local")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: tiny (local), else 7b")
    parser.add_argument("--model-dir", help="the model's Hugging Face directory (model.hf_path)")
    parser.add_argument("--data", help="prompts, jsonl or parquet (data.path)")
    parser.add_argument("--name", default="bapo")
    parser.add_argument("--nodes", type=int, default=1, help="slurm: nodes (8 GPUs each)")
    parser.add_argument("--account")
    parser.add_argument("--partition")
    parser.add_argument("--time", default="04:00:00")
    parser.add_argument("--container-image")
    parser.add_argument("--mount", action="append", default=[], help="host:container, repeatable")
    parser.add_argument("--ssh-host", help="slurm: submit over SSH to this login node")
    parser.add_argument("--ssh-user")
    parser.add_argument("--job-dir", default=str(ROOT / "runs" / "nemo_run"), help="where NeMo-Run keeps its files")
    parser.add_argument(
        "--root", type=Path, help="the checkout where the job runs (default: this one; in a container: the image's)"
    )
    parser.add_argument("--dryrun", action="store_true", help="print the job as it would be submitted; run nothing")
    opts = parser.parse_args(argv)
    preset = opts.preset or ("tiny" if opts.executor == "local" else "qwen2.5-7b")
    overrides = list(opts.overrides)
    if opts.executor != "local":  # the engines on the first node's GPUs, beside the trainer
        from bapo_megatron.config import load_config

        engine_tp = load_config(PRESETS[preset]).rollout.engines.tensor_parallel
        # colocated engines give their memory to the trainer while it trains: generation is synchronous
        overrides += [
            "rollout.mode=sync",
            "rollout.engines.colocate=true",
            f"rollout.engines.servers={GPUS_PER_NODE // engine_tp}",
        ]
    import nemo_run as run

    root = opts.root or (Path(IMAGE_ROOT) if opts.container_image else ROOT)
    job = recipe(preset, overrides, root=root, model_dir=opts.model_dir, data=opts.data)
    with run.Experiment(opts.name, executor=executor(opts.executor, opts), log_level="WARN") as exp:
        exp.add(job, name=opts.name, tail_logs=False)
        if opts.dryrun:
            exp.dryrun()
            return 0
        exp.run(sequential=True)
    # (leaving the experiment waited for the job)
    if opts.executor == "local":  # NeMo-Run keeps no status for local jobs: the run's own word
        from bapo_megatron.config import load_config
        from bapo_megatron.runinfo import RunStatus

        status = RunStatus.read(load_config(PRESETS[preset], job.args[1:]).run_path)
        state = status.state if status is not None else "failed (no readable status.json)"
    else:
        state = str((exp.status(return_dict=True) or {}).get(opts.name, {}).get("status", "unknown"))
    if state.lower() not in ("finished", "succeeded", "appstate.succeeded"):
        print(f"error: the job ended {state}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
