#!/usr/bin/env bash
# BAPO on Qwen2.5-7B with the paper's settings (examples/qwen2.5-7b/config.yaml), 8xH100 nodes: the
# trainer on 1 trainer node, one srun task per GPU (no torchrun); SGLang servers on 1 rollout node,
# reached over rollout.engines.urls, weights pushed to them over NCCL after every step. COLOCATE=1
# and --nodes=1: no rollout nodes, the servers share the trainer's GPUs. The plan, as the dry run
# prints it (tests/unit/test_preset_docs.py runs each `$` line here and compares; ... stands for
# what a line leaves out):
#   $ bapo-train examples/qwen2.5-7b/config.yaml --dry-run
#   # no --world-size: planned for 8 trainer processes, as slurm/bapo_7b.sh runs this config: 1 trainer node(s) x 8 GPUs, 1 rollout node(s)
#   trainer: 8 processes, TP 4 x PP 1 x DP 2
#   activation recompute: none; estimated peak 46.2 GiB fits the 73.0 GiB usable of each 80 GiB GPU
#   engines: 4 sglang server(s), TP 2 each, on rollout nodes as slurm/bapo_7b.sh places them: 1 node(s) x 4 server(s) ...
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
