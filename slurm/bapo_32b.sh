#!/usr/bin/env bash
# BAPO on Qwen2.5-32B with the paper's settings (examples/qwen2.5-32b/config.yaml), 8xH100 nodes: the
# trainer on 4 trainer nodes, one srun task per GPU (no torchrun); SGLang servers on 2 rollout nodes,
# reached over rollout.engines.urls, weights pushed to them over NCCL after every step. COLOCATE=1
# and --nodes=4: no rollout nodes, the servers share the trainer's GPUs. The preset trains 32k-token
# responses, activation recompute chosen to fit (parallel.recompute auto);
# CONFIG=examples/qwen2.5-32b/long.yaml runs the same layout with 64k-token responses. The plan, as
# the dry run prints it (tests/unit/test_preset_docs.py runs each `$` line here and compares; ...
# stands for what a line leaves out):
#   $ bapo-train examples/qwen2.5-32b/config.yaml --dry-run
#   # no --world-size: planned for 32 trainer processes, as slurm/bapo_32b.sh runs this config: 4 trainer node(s) x 8 GPUs, 2 rollout node(s)
#   trainer: 32 processes, TP 8 x PP 2 x DP 2
#   activation recompute: auto chose full: 8 of the 32 layers of each pipeline stage run again in the backward pass, about +8% step compute; the least whose estimated peak, 71.6 GiB, fits ...
#   engines: 4 sglang server(s), TP 4 each, on rollout nodes as slurm/bapo_32b.sh places them: 2 node(s) x 2 server(s) ...
# LoRA on two nodes (examples/qwen2.5-32b/lora.yaml, the base frozen, adapters trained: one trainer
# node, one rollout node; the preset's README has its dry run):
#   TRAIN_NODES=1 CONFIG=examples/qwen2.5-32b/lora.yaml MODEL_DIR=... DATA=... sbatch --nodes=2 slurm/bapo_32b.sh
# Near the time limit Slurm sends USR1: the trainer saves at the step boundary, the job requeues
# itself and resumes from the checkpoint. When the run is done, the checkpoint goes to HF format.
#
#   MODEL_DIR=/models/Qwen2.5-32B DATA=/data/math.jsonl sbatch slurm/bapo_32b.sh [key=value ...]
#   MODEL_DIR=/models/Qwen2.5-32B CONFIG=examples/qwen2.5-32b/recipe.yaml sbatch slurm/bapo_32b.sh \
#     data.path=/data/dapo-math-17k.parquet ...   # a data.path=... argument stands for DATA
#
# Optional: RUN_DIR, CONTAINER_IMAGE (+ CONTAINER_MOUNTS), NET_IF, TRAIN_NODES, ENGINES_PER_NODE,
# COLOCATE; see slurm/common.sh. Arguments are config overrides for bapo-train.
#SBATCH --job-name=bapo-32b
#SBATCH --nodes=6
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

CONFIG=${CONFIG:-examples/qwen2.5-32b/config.yaml}
# shellcheck source=slurm/common.sh
source "${BAPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/common.sh"
bapo_gpu_job 4 2 4 "$@" # trainer nodes, SGLang servers a rollout node, their TP
