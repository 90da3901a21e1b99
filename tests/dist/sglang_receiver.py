"""SGLang 0.5.23's receiving end of a weight update, on CPU: its own code behind our HTTP subset.

    python -m tests.dist.sglang_receiver --port P --out DIR

The group join, the per-tensor and flattened receives and the group's destruction are SGLang's
WeightUpdater methods (init_weights_update_group, receive_weights_from_distributed,
_receive_bucketed_weights_from_distributed, destroy_weights_update_group), with its
init_custom_process_group, NetworkAddress and FlattenedTensorBucket, compiled from the wheel
(tests/sglang_wheel.py) and bound to a stand-in for the model runner (tp_rank 0, device cpu).
As in SGLang's server, a default process group exists before any weight-update group (its TP
world, here of one). Each received bucket is written to DIR/<version>-<n>.safetensors, so the
test compares what arrived with what was sent, bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import zipfile
from pathlib import Path

import torch


def sglang_updater(wheel: zipfile.ZipFile):
    """A stand-in model runner carrying SGLang's own weight-update methods."""
    from tests.sglang_wheel import load_defs

    ns = load_defs(
        wheel,
        {
            "utils/network.py": ["_is_ipv6", "_wrap", "NetworkAddress"],
            "weight_sync/tensor_bucket.py": ["FlattenedTensorMetadata", "FlattenedTensorBucket"],
            "utils/common.py": ["init_custom_process_group"],
            "model_executor/model_runner_components/weight_updater.py": [
                "WeightUpdater.init_weights_update_group",
                "WeightUpdater.receive_weights_from_distributed",
                "WeightUpdater._receive_bucketed_weights_from_distributed",
                "WeightUpdater.destroy_weights_update_group",
            ],
        },
        {"torch": torch, "logger": logging.getLogger("sglang"), "torch_release": _release(torch.__version__)},
    )
    methods = {
        name: ns[name]
        for name in (
            "init_weights_update_group",
            "receive_weights_from_distributed",
            "_receive_bucketed_weights_from_distributed",
            "destroy_weights_update_group",
        )
    }
    runner = type("SGLangWeightUpdater", (), methods)()
    runner.tp_rank, runner.device, runner._model_update_group = 0, torch.device("cpu"), {}
    return runner


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def app(runner, out: Path):
    from aiohttp import web

    received = {"count": 0}

    async def answer(success: bool, message: str):
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def init_group(request):
        body = await request.json()
        ok, message = await asyncio.to_thread(
            runner.init_weights_update_group,
            body["master_address"],
            body["master_port"],
            body["rank_offset"],
            body["world_size"],
            body["group_name"],
            body["backend"],
        )
        return await answer(ok, message)

    async def destroy_group(request):
        body = await request.json()
        return await answer(*runner.destroy_weights_update_group(body["group_name"]))

    async def update(request):
        from safetensors.torch import save_file

        body = await request.json()
        weights = await asyncio.to_thread(
            runner.receive_weights_from_distributed,
            names=body["names"],
            dtypes=body["dtypes"],
            shapes=body["shapes"],
            group_name=body["group_name"],
            load_format=body.get("load_format"),
        )
        received["count"] += 1
        save_file(
            {n: t.contiguous() for n, t in weights},
            str(out / f"{body['weight_version']}-{received['count']}.safetensors"),
            metadata={"flush_cache": str(body["flush_cache"])},
        )
        return await answer(True, f"received {len(weights)} tensors")

    async def session(request):
        return await answer(True, "ok")

    async def health(request):
        return web.json_response({})

    application = web.Application(client_max_size=1 << 30)
    application.router.add_get("/health", health)
    for path, handler in {
        "/init_weights_update_group": init_group,
        "/destroy_weights_update_group": destroy_group,
        "/update_weights_from_distributed": update,
        "/begin_weight_update": session,
        "/end_weight_update": session,
    }.items():
        application.router.add_post(path, handler)
    return application


def main() -> None:
    import torch.distributed as dist
    from aiohttp import web

    from tests.sglang_wheel import wheel_path

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    store = dist.HashStore()  # SGLang's server has its TP world as the default group (here: one rank)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    runner = sglang_updater(zipfile.ZipFile(wheel_path()))
    web.run_app(app(runner, Path(args.out)), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
