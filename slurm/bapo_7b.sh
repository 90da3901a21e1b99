#!/usr/bin/env bash
# BAPO on Qwen2.5-7B with the paper's settings (examples/qwen2.5-7b/config.yaml), 8xH100 nodes:
#   trainer  1 node: TP 4 x DP 2 = 8 ranks, one srun task per GPU (no torchrun);
#   rollout  1 node: SGLang servers (4 a node, TP 2 each), reached over rollout.engines.urls,
#            weights pushed to them over NCCL after every step;
#   COLOCATE=1 and --nodes=1: no rollout nodes, the servers share the first trainer node's GPUs.
# Near the time limit Slurm sends USR1: the trainer saves at the step boundary, the job requeues
# itself and resumes from the checkpoint. When the run is done, the checkpoint goes to HF format.
#
#   MODEL_DIR=/models/Qwen2.5-7B DATA=/data/math.jsonl sbatch slurm/bapo_7b.sh [key=value ...]
#   MODEL_DIR=/models/Qwen2.5-7B CONFIG=examples/qwen2.5-7b/recipe.yaml sbatch slurm/bapo_7b.sh \
#     data.path=/data/dapo-math-17k.parquet ...   # a data.path=... argument stands for DATA
#
# Optional: RUN_DIR, CONTAINER_IMAGE (+ CONTAINER_MOUNTS), NET_IF, TRAIN_NODES, ENGINES_PER_NODE,
# COLOCATE; see slurm/common.sh. Arguments are config overrides for bapo-train.
#SBATCH --job-name=bapo-7b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

CONFIG=${CONFIG:-examples/qwen2.5-7b/config.yaml}
# shellcheck source=slurm/common.sh
source "${BAPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/common.sh"
bapo_gpu_job 1 4 2 "$@" # trainer nodes, SGLang servers a rollout node, their TP
