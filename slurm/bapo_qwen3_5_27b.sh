#!/usr/bin/env bash
# BAPO on Qwen3.5-27B (Gated DeltaNet hybrid, dense) with the paper's settings
# (examples/qwen3.5-27b/config.yaml), 8xH100 nodes: the trainer on 4 trainer nodes, one srun task per
# GPU (no torchrun), Megatron's local modules (the hybrid has no Transformer Engine spec), full
# recompute of most layers to fit 16k-token responses (parallel.recompute auto); SGLang servers on 2
# rollout nodes, reached over rollout.engines.urls, weights pushed to them over NCCL after every
# step. COLOCATE=1 and --nodes=4: no rollout nodes, the servers share the trainer's GPUs. The plan,
# as the dry run prints it
# (tests/unit/test_preset_docs.py runs each `$` line here and compares; ... stands for what a line
# leaves out):
#   $ bapo-train examples/qwen3.5-27b/config.yaml --dry-run
#   # no --world-size: planned for 32 trainer processes, as slurm/bapo_qwen3_5_27b.sh runs this config: 4 trainer node(s) x 8 GPUs, 2 rollout node(s)
#   trainer: 32 processes, TP 4 x PP 2 x DP 4
#   activation recompute: auto chose full: 26 of the 32 layers of each pipeline stage run again in the backward pass, about +26% step compute; the least whose estimated peak, 69.0 GiB, fits ...
#   engines: 4 sglang server(s), TP 4 each, on rollout nodes as slurm/bapo_qwen3_5_27b.sh places them: 2 node(s) x 2 server(s) ...
# MODEL_DIR is the released checkpoint (Qwen3_5ForConditionalGeneration): the text model trains, its
# vision tower and MTP layer are carried and written back untouched in the HF export.
# Near the time limit Slurm sends USR1: the trainer saves at the step boundary, the job requeues
# itself and resumes from the checkpoint. When the run is done, the checkpoint goes to HF format.
#
#   MODEL_DIR=/models/Qwen3.5-27B DATA=/data/math.jsonl sbatch slurm/bapo_qwen3_5_27b.sh [key=value ...]
#
# Optional: RUN_DIR, CONTAINER_IMAGE (+ CONTAINER_MOUNTS), NET_IF, TRAIN_NODES, ENGINES_PER_NODE,
# COLOCATE; see slurm/common.sh. Arguments are config overrides for bapo-train.
#SBATCH --job-name=bapo-qwen3.5-27b
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

CONFIG=${CONFIG:-examples/qwen3.5-27b/config.yaml}
# shellcheck source=slurm/common.sh
source "${BAPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/common.sh"
bapo_gpu_job 4 2 4 "$@" # trainer nodes, SGLang servers a rollout node, their TP
