#!/usr/bin/env bash
# The CPU demo's BAPO phase (examples/demo/rl.yaml) as a Slurm job on one CPU node: the addition
# task and its tiny Qwen2 (made once in RUN_DIR/task), the embedded engine, partial rollout,
# checkpoints every CHECKPOINT_INTERVAL steps, requeue on the time-limit warning, HF export at the end.
#
#   sbatch slurm/bapo_tiny_cpu.sh [key=value ...]
#   STEPS=5 RUN_DIR=/scratch/tiny sbatch slurm/bapo_tiny_cpu.sh
#
# Optional: STEPS (default: the config's), CHECKPOINT_INTERVAL (1), SFT_CKPT (a warm start, e.g.
# runs/demo/sft/ckpt from examples/demo.py; without it BAPO starts from the untrained tiny model),
# RUN_DIR, CONTAINER_IMAGE; see slurm/common.sh. Arguments are config overrides for bapo-train.
#SBATCH --job-name=bapo-tiny-cpu
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

CONFIG=${CONFIG:-examples/demo/rl.yaml}
# shellcheck source=slurm/common.sh
source "${BAPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/common.sh"

TASK_DIR=$RUN_DIR/task
if [[ ! -f $TASK_DIR/train.jsonl ]]; then
    run "$PYTHON" -m bapo_megatron.tasks addition "$TASK_DIR" --heldout 200
fi
ARGS=(
    "name=$SLURM_JOB_NAME"
    "model.hf_path=$TASK_DIR/model"
    "data.path=$TASK_DIR/train.jsonl"
    "eval.path=$TASK_DIR/heldout.jsonl"
    "run_dir=$RUN_DIR"
    "checkpoint.dir=$RUN_DIR/ckpt"
    "checkpoint.interval=${CHECKPOINT_INTERVAL:-1}"
    # the embedded engine's port: one of this job's, so that jobs sharing a node do not collide
    "rollout.engines.port=$((30000 + ${SLURM_JOB_ID:-0} % 20000))"
)
if [[ -n ${STEPS:-} ]]; then
    ARGS+=("steps=$STEPS")
fi
if [[ -n ${SFT_CKPT:-} ]]; then
    ARGS+=("model.mcore_path=$SFT_CKPT")
fi
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-2}

trainer_rendezvous "$(hostname)"
run_trainer --nodes=1 --ntasks=1 -- "${ARGS[@]}" "$@"
requeue_or_finish
export_hf "$TASK_DIR/model"
