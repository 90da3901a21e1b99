# bapo-megatron for H100 nodes: CUDA 13, torch as SGLang 0.5.23 pins it, Transformer Engine 2.11 and
# apex built against that torch, megatron-core 0.16.1, SGLang 0.5.23, nemo-run, wandb, this package.
#
#   docker build -t bapo-megatron:0.1 .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v /models:/models -v /data:/data -v "$PWD/runs:/opt/bapo-megatron/runs" \
#       bapo-megatron:0.1 examples/qwen2.5-32b/config.yaml model.hf_path=/models/Qwen2.5-32B data.path=/data/math.jsonl
#
# One Python environment, not two: SGLang 0.5.23 pins torch (2.14.1), and that torch is the one the
# trainer runs too. Transformer Engine's torch extension and apex are compiled here, against it, so
# no second torch exists for a mismatched extension to load against; the trainer and the SGLang
# servers are separate processes of the same environment and exchange weights over NCCL or CUDA IPC
# handles, which need the same torch and CUDA on both ends. (`pip install --dry-run` resolves
# sglang 0.5.23 + megatron-core 0.16.1 + TE 2.11.0 + nemo-run + wandb together: issue 13's note.)
#
# The base is pinned by tag. Pin its digest too when you build (this file was written on machines
# that cannot reach a registry, so the digest is not filled in here):
#   docker buildx imagetools inspect nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
#   -> FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04@sha256:<digest>
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ARG PYTHON=python3.12
# apex: a commit of NVIDIA/apex's main branch; its CUDA extensions (fused gradient accumulation,
# fused layer norm) are compiled against the torch installed below
ARG APEX_COMMIT=705cba91fc26413d484f5ce2983427d840199a97
# Hopper only (H100/H200): compile the CUDA kernels once, for compute capability 9.0
ARG TORCH_CUDA_ARCH_LIST=9.0
ARG MAX_JOBS=16

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev git ninja-build build-essential curl ca-certificates \
        libibverbs1 numactl \
    && rm -rf /var/lib/apt/lists/*

RUN ${PYTHON} -m venv /opt/venv \
    && pip install --upgrade pip==25.3 setuptools==80.9.0 wheel==0.45.1 packaging==25.0 ninja==1.13.0

# 1. SGLang first: it pins torch (and the CUDA wheels), which everything compiled below builds against
RUN pip install "sglang==0.5.23" \
    && python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

# 2. Transformer Engine 2.11.0 (inside megatron-core 0.16.1's tested >= 2.9, < 2.12): the CUDA 13 core
#    wheel, and its torch extension built from the sdist against the torch of step 1
RUN pip install --no-build-isolation "transformer-engine[pytorch,core_cu13]==2.11.0"

# 3. apex from the pinned commit, with its C++ and CUDA extensions
RUN git clone https://github.com/NVIDIA/apex.git /tmp/apex \
    && git -C /tmp/apex checkout "${APEX_COMMIT}" \
    && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install --no-build-isolation /tmp/apex \
    && rm -rf /tmp/apex \
    && python -c "import fused_weight_gradient_mlp_cuda, apex; print('apex ok')"

# 4. this package; its dependencies are pinned or bounded in pyproject.toml (megatron-core 0.16.1,
#    nemo-run 0.11.1, wandb, math-verify, ...)
WORKDIR /opt/bapo-megatron
COPY pyproject.toml README.md ./
COPY bapo_megatron ./bapo_megatron
# hadolint ignore=DL3013
RUN pip install --no-build-isolation ".[gpu,sglang]"
COPY examples ./examples
COPY tools ./tools
COPY slurm ./slurm
COPY benchmarks ./benchmarks

# A non-root user owns the runs; mount a volume at /opt/bapo-megatron/runs to keep them.
RUN useradd --create-home --uid 1000 bapo \
    && mkdir -p /opt/bapo-megatron/runs \
    && chown -R bapo:bapo /opt/bapo-megatron/runs
USER 1000:1000

ENTRYPOINT ["bapo-train"]
CMD ["--help"]
