"""Process groups of one trainer process: Megatron's parallel state, passed around explicitly."""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bapo_megatron.config import ParallelConfig


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in the tensor x pipeline x data (x context) layout and its groups."""

    tp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    pp_group: dist.ProcessGroup
    pp_rank: int
    pp_size: int
    dp_cp_group: dist.ProcessGroup
    """Data x context parallel: where BAPO's statistics and the loss's token counts are summed."""
    dp_rank: int
    dp_size: int
    ep_group: dist.ProcessGroup | None = None
    """Expert parallel: the ranks whose experts together make a MoE layer's (None: EP = 1)."""
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0


def single_process_env() -> None:
    """The rendezvous environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): torchrun's
    as it is; in a Slurm job step (`srun bapo-train ...`, one task per GPU), from Slurm's variables,
    with MASTER_ADDR and MASTER_PORT from the job script (the first node, a port of the job's);
    elsewhere a world of one on this machine (a free loopback port)."""
    if "RANK" in os.environ:
        return
    if "SLURM_STEP_NUM_TASKS" in os.environ and "SLURM_PROCID" in os.environ:  # inside srun, not the batch script
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing and int(os.environ["SLURM_STEP_NUM_TASKS"]) > 1:
            raise RuntimeError(
                f"srun with {os.environ['SLURM_STEP_NUM_TASKS']} tasks: export {' and '.join(missing)} in the "
                "job script (the first node of the job and a free port, as slurm/bapo_32b.sh does)"
            )
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_STEP_NUM_TASKS"],
            LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        )
        if not missing:
            return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def local_world_size() -> int:
    """The trainer's ranks on this node (one a GPU, by LOCAL_RANK): torchrun's LOCAL_WORLD_SIZE; in
    an srun step, this node's entry of SLURM_STEP_TASKS_PER_NODE; else (RANK set by some other
    launcher) as many as the world and this node's GPUs allow. ValueError for a Slurm list that
    does not parse."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if "SLURM_STEP_TASKS_PER_NODE" in os.environ:
        return tasks_on_node(os.environ["SLURM_STEP_TASKS_PER_NODE"], int(os.environ.get("SLURM_NODEID", "0")))
    return min(int(os.environ.get("WORLD_SIZE", "1")), max(1, torch.cuda.device_count()))


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Slurm's SLURM_STEP_TASKS_PER_NODE ("8(x2),4": 8 tasks on each of two nodes, then 4) at `node`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}: not Slurm's N or N(xK) list")
        counts += [int(match[1])] * int(match[2] or 1)
    if not 0 <= node < len(counts):
        raise ValueError(f"SLURM_NODEID={node}: SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} names {len(counts)} nodes")
    return counts[node]


def init_distributed() -> None:
    """Join the job's default process group (torchrun / srun environment), NCCL on GPU, gloo on CPU."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def init_model_parallel(parallel: ParallelConfig, seed: int) -> ParallelInfo:
    """Megatron's groups for `parallel` over the already-initialised world; seeds every RNG."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel.data_parallel_size(dist.get_world_size())  # a clear error before Megatron's own assert
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor,
            pipeline_model_parallel_size=parallel.pipeline,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
            context_parallel_size=parallel.context,
            expert_model_parallel_size=parallel.expert,
            expert_tensor_parallel_size=1,
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return ParallelInfo(
        tp_group=ps.get_tensor_model_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        ep_group=ps.get_expert_model_parallel_group() if parallel.expert > 1 else None,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
    )


def destroy_model_parallel() -> None:
    """Megatron's groups destroyed where they were made. A run interrupted while Megatron was being
    imported has none, and importing it again would fail on the half-imported modules (an
    AttributeError from torch._dynamo in place of the interrupt's own exit)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and hasattr(ps, "destroy_model_parallel"):
        ps.destroy_model_parallel()
