#!/usr/bin/env bash
# BAPO on Qwen3.5-27B (Gated DeltaNet hybrid, dense) with the paper's settings
# (examples/qwen3.5-27b/config.yaml), 8xH100 nodes:
#   trainer  4 nodes: TP 4 x PP 2 x DP 4 = 32 ranks, sequence parallel, one srun task per GPU (no
#            torchrun); Megatron's local modules (the hybrid has no Transformer Engine spec), full
#            recompute of most layers to fit 16k-token responses (parallel.recompute auto);
#   rollout  2 nodes: SGLang servers (2 a node, TP 4 each), reached over rollout.engines.urls,
#            weights pushed to them over NCCL after every step;
#   COLOCATE=1 and --nodes=4: no rollout nodes, the servers share the first trainer node's GPUs.
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
