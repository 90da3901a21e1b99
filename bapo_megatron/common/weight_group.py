"""The weight-update process group, each end built with the calls SGLang 0.5.23 makes for its own.

SGLang's /init_weights_update_group joins through init_custom_process_group
(sglang/srt/utils/common.py): a tcp:// rendezvous in which rank 0 hosts the TCPStore, the store
wrapped in PrefixStore(group_name), then torch's _new_process_group_helper(..., group_name=...),
which prefixes every key again with "{group_name}/" and "{device}/". A group built any other way
(a bare ProcessGroupGloo/NCCL on PrefixStore(group_name), init_process_group) waits on keys
SGLang never writes: gloo times out, NCCL hangs at the first broadcast. So the trainer's end
(rank 0) and the embedded engine's join both come from `join_group` here, and
tests/unit/test_sglang_weight_group.py meets SGLang's own function, read from its wheel.

_new_process_group_helper is private torch API (as in SGLang, verl and slime, which all build
the group this way); its keyword for backend options is `backend_options` since torch 2.6.
"""

from __future__ import annotations

import datetime
import ipaddress

import torch.distributed as dist


def tcp_address(host: str, port: int) -> str:
    """tcp://host:port, IPv6 addresses in brackets (SGLang's NetworkAddress.to_tcp)."""
    host = host.strip("[]")
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"tcp://{host}:{port}"


def join_group(
    host: str, port: int, rank: int, world_size: int, group_name: str, backend: str = "gloo", timeout_s: float = 600.0
) -> dist.ProcessGroup:
    """This process's end of the weight-update group; rank 0 hosts the rendezvous store at (host, port).

    Blocks until all `world_size` ranks have joined. A group of the same name that this process
    still holds must be left first (`leave_group`): torch refuses a second group of one name."""
    from torch.distributed import distributed_c10d as c10d

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a group of {world_size}")
    if group_name in c10d._world.pg_names.values():
        raise ValueError(f"this process already holds a weight-update group {group_name!r}: leave it first")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The store c10d.rendezvous(tcp_address(host, port)) makes, made here: under torchrun (whose
    # TORCHELASTIC_USE_AGENT_STORE the trainer inherits) rendezvous would connect to the job's agent
    # store instead, and rank 0 would wait forever for engines that join a store it never hosts.
    store = dist.TCPStore(
        host.strip("[]"), port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True, use_libuv=True
    )
    store = dist.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group rank == rank in the group
    return group


def leave_group(group: dist.ProcessGroup | None) -> None:
    """Destroy a group made by `join_group` (its name is free again); None or one already gone: nothing."""
    from torch.distributed import distributed_c10d as c10d

    if group is not None and group in c10d._world.pg_map:
        dist.destroy_process_group(group)


def join_requested(body: dict, default_name: str, timeout_s: float = 300.0) -> tuple[str, dist.ProcessGroup]:
    """An engine's end of the group an /init_weights_update_group body asks it to join (gloo, as
    the CPU engines here join): (its name, the group)."""
    if body.get("backend", "gloo") != "gloo":
        raise ValueError(f"this engine joins gloo groups only, not {body.get('backend')!r}")
    name = body.get("group_name", default_name)
    args = (body["master_address"], int(body["master_port"]), int(body["rank_offset"]), int(body["world_size"]))
    return name, join_group(*args, name, "gloo", timeout_s)
