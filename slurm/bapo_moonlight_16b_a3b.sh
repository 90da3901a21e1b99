#!/usr/bin/env bash
# BAPO on Moonlight-16B-A3B (DeepSeek-V3's architecture: multi-latent attention, 64 experts top-6,
# 2 shared) with the paper's settings (examples/moonlight-16b-a3b/config.yaml), 8xH100 nodes: the
# trainer on 1 trainer node, one srun task per GPU (no torchrun), the node's 8 ranks one
# expert-parallel group (8 experts a rank); SGLang servers on 1 rollout node, reached over
# rollout.engines.urls, weights pushed to them over NCCL after every step, started with
# --enable-return-routed-experts for routing replay. COLOCATE=1 and --nodes=1: no rollout nodes, the
# servers share the trainer's GPUs. The plan, as the dry run prints it
# (tests/unit/test_preset_docs.py runs each `$` line here and compares; ... stands for what a line
# leaves out):
#   $ bapo-train examples/moonlight-16b-a3b/config.yaml --dry-run
#   # no --world-size: planned for 8 trainer processes, as slurm/bapo_moonlight_16b_a3b.sh runs this config: 1 trainer node(s) x 8 GPUs, 1 rollout node(s)
#   trainer: 8 processes, TP 2 x PP 1 x EP 8 x DP 4
#   activation recompute: auto chose none; the least whose estimated peak, 55.9 GiB, fits ...
#   engines: 4 sglang server(s), TP 2 each, on rollout nodes as slurm/bapo_moonlight_16b_a3b.sh places them: 1 node(s) x 4 server(s) ...
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
