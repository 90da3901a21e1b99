#!/usr/bin/env bash
# BAPO on Qwen3-30B-A3B (128 experts, top-8) with the paper's settings
# (examples/qwen3-30b-a3b/config.yaml), 8xH100 nodes: the trainer on 4 trainer nodes, one srun task
# per GPU (no torchrun), each node's 8 ranks one expert-parallel group (16 experts a rank); SGLang
# servers on 2 rollout nodes, reached over rollout.engines.urls, weights pushed to them over NCCL
# after every step. COLOCATE=1 and --nodes=4: no rollout nodes, the servers share the trainer's GPUs.
# The plan, as the dry run prints it (tests/unit/test_preset_docs.py runs each `$` line here and
# compares; ... stands for what a line leaves out):
#   $ bapo-train examples/qwen3-30b-a3b/config.yaml --dry-run
#   # no --world-size: planned for 32 trainer processes, as slurm/bapo_qwen3_30b_a3b.sh runs this config: 4 trainer node(s) x 8 GPUs, 2 rollout node(s)
#   trainer: 32 processes, TP 4 x PP 1 x EP 8 x DP 8
#   activation recompute: none; estimated peak 63.4 GiB fits the 73.0 GiB usable of each 80 GiB GPU
#   engines: 4 sglang server(s), TP 4 each, on rollout nodes as slurm/bapo_qwen3_30b_a3b.sh places them: 2 node(s) x 2 server(s) ...
# TRAIN_NODES=2 (and --nodes=4), 16 trainer processes, is refused as the preset is (74.1 GiB a GPU
# against 73.0 usable); with the argument parallel.recompute=auto it runs, recomputing 4 of the 48
# layers (+3% step compute) at 72.6 GiB, nothing left for unevenly routed tokens:
#   $ bapo-train examples/qwen3-30b-a3b/config.yaml --dry-run --world-size 16
#   error: parallel.recompute='none': does not fit: with parallel.recompute=none the estimated peak is 74.1 GiB a GPU ...
#   $ bapo-train examples/qwen3-30b-a3b/config.yaml parallel.recompute=auto --dry-run --world-size 16
#   trainer: 16 processes, TP 4 x PP 1 x EP 8 x DP 4
#   activation recompute: auto chose full: 4 of the 48 layers of each pipeline stage run again in the backward pass, about +3% step compute ...
# LoRA on two nodes (examples/qwen3-30b-a3b/lora.yaml, the base frozen, attention adapters trained:
# one trainer node, one rollout node; the preset's README has its dry run):
#   TRAIN_NODES=1 CONFIG=examples/qwen3-30b-a3b/lora.yaml MODEL_DIR=... DATA=... sbatch --nodes=2 \
#     slurm/bapo_qwen3_30b_a3b.sh
# Near the time limit Slurm sends USR1: the trainer saves at the step boundary, the job requeues
# itself and resumes from the checkpoint. When the run is done, the checkpoint goes to HF format.
#
#   MODEL_DIR=/models/Qwen3-30B-A3B DATA=/data/math.jsonl sbatch slurm/bapo_qwen3_30b_a3b.sh [key=value ...]
#
# Optional: RUN_DIR, CONTAINER_IMAGE (+ CONTAINER_MOUNTS), NET_IF, TRAIN_NODES, ENGINES_PER_NODE,
# COLOCATE; see slurm/common.sh. Arguments are config overrides for bapo-train.
#SBATCH --job-name=bapo-qwen3-30b-a3b
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

CONFIG=${CONFIG:-examples/qwen3-30b-a3b/config.yaml}
# shellcheck source=slurm/common.sh
source "${BAPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/common.sh"
bapo_gpu_job 4 2 4 "$@" # trainer nodes, SGLang servers a rollout node, their TP
