#!/usr/bin/env bash
# BAPO on Moonlight-16B-A3B (DeepSeek-V3's architecture: multi-latent attention, 64 experts top-6,
# 2 shared) with the paper's settings (examples/moonlight-16b-a3b/config.yaml), 8xH100 nodes:
#   trainer  1 node: TP 2 x EP 8 x DP 4 = 8 ranks, sequence parallel, one srun task per GPU (no
#            torchrun); the node's 8 ranks are one expert-parallel group (8 experts a rank);
#   rollout  1 node: SGLang servers (4 a node, TP 2 each), reached over rollout.engines.urls,
#            weights pushed to them over NCCL after every step; routing replay starts them with
#            --enable-return-routed-experts;
#   COLOCATE=1 and --nodes=1: no rollout nodes, the servers share the trainer node's GPUs.
# MODEL_DIR is a Hugging Face directory transformers' own DeepseekV3 classes load: the hub's
# config.json names its own code (auto_map), which bapo-train refuses; remove that key first.
# Near the time limit Slurm sends USR1: the trainer saves at the step boundary, the job requeues
# itself and resumes from the checkpoint. When the run is done, the checkpoint goes to HF format.
#
#   MODEL_DIR=/models/Moonlight-16B-A3B DATA=/data/math.jsonl sbatch slurm/bapo_moonlight_16b_a3b.sh [key=value ...]
#
# Optional: RUN_DIR, CONTAINER_IMAGE (+ CONTAINER_MOUNTS), NET_IF, TRAIN_NODES, ENGINES_PER_NODE,
# COLOCATE; see slurm/common.sh. Arguments are config overrides for bapo-train.
#SBATCH --job-name=bapo-moonlight-16b-a3b
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

CONFIG=${CONFIG:-examples/moonlight-16b-a3b/config.yaml}
# shellcheck source=slurm/common.sh
source "${BAPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/common.sh"
bapo_gpu_job 1 4 2 "$@" # trainer nodes, SGLang servers a rollout node, their TP
