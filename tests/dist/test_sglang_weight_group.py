"""Our weight sender against SGLang 0.5.23's own receiving code (tests/dist/sglang_receiver.py).

Two engine processes, each running SGLang's init_weights_update_group (its
init_custom_process_group over tcp://), receive_weights_from_distributed and
FlattenedTensorBucket from the wheel, join the trainer's group at rank offsets 1 and 2. The
trainer (a torchrun-like worker with its own default group, as in a real job) sends a bucket
flattened and per tensor; every tensor must arrive bit for bit, with the cache flushed only
by the last bucket of a sync. Then one engine is killed and restarted and the trainer
reconnects under the same group name and port; and once more with both engines alive (each
leaves the old group first). Skipped only when the wheel cannot be downloaded.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from bapo_megatron.engines.launcher import ServerProcess, free_port
from tests.dist.launch import run_workers
from tests.sglang_wheel import WheelUnavailable, wheel_path

REPO = Path(__file__).resolve().parents[2]
GROUP = "weight_update_group"  # SGLang's default name


def _bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(8, 5, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.qkv_proj.bias", torch.randn(6, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5, generator=g, dtype=torch.float64)),
        ("lm_head.weight", torch.randn(2, 3, 4, generator=g).to(torch.float16)),
    ]


def _receiver(out: Path, index: int) -> ServerProcess:
    port = free_port()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    return ServerProcess(
        [sys.executable, "-m", "tests.dist.sglang_receiver", "--port", str(port), "--out", str(out)],
        f"http://127.0.0.1:{port}",
        out / f"receiver-{index}.log",
        env,
    )


def _trainer(rank: int, world: int, control: str) -> None:
    """Rank 0 of the weight-update group; `control` is a directory through which the test
    restarts an engine between phases (the trainer waits for its new URL)."""
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.engines.loop import EngineLoop
    from bapo_megatron.weights.sync import DistributedWeightSender

    def urls(phase: int) -> list[str]:
        path = Path(control) / f"urls-{phase}.json"
        while not path.exists():
            import time

            time.sleep(0.05)
        return json.loads(path.read_text())

    loop = EngineLoop()
    port = free_port()
    clients = [EngineClient(u) for u in urls(0)]
    sender = DistributedWeightSender(clients, [1, 1], "127.0.0.1", port, group_name=GROUP, timeout_s=120)
    assert sender.backend == "gloo"  # no CUDA here
    loop.run(sender.connect())
    sender.send([_bucket(1), _bucket(2)], "flat", loop)
    sender.flatten = False
    sender.send([_bucket(3)], "per-tensor", loop)
    (Path(control) / "done-0").touch()
    # engine 1 is killed and restarted: same group name, same port, a new group on both ends
    new = urls(1)
    loop.run(clients[1].close())
    clients[1] = EngineClient(new[1])
    sender.clients = clients
    loop.run(sender.connect())
    sender.flatten = True
    sender.send([_bucket(4)], "after-restart", loop)
    loop.run(sender.connect())  # both alive: each leaves the old group, then all join the new one
    sender.send([_bucket(5)], "reconnected", loop)
    loop.run(sender.close())
    for c in clients:
        loop.run(c.close())
    loop.close()
    (Path(control) / "done-1").touch()


def _wait(path: Path, engines: list[ServerProcess], workers) -> None:
    import time

    while not path.exists():
        for e in engines:
            assert e.process.poll() is None, f"engine exited:\n{e.log_tail()}"
        assert workers.is_alive(), "the trainer exited early"
        time.sleep(0.05)


def _received(out: Path, version: str) -> list[tuple[dict, dict]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    files = sorted(out.glob(f"{version}-*.safetensors"), key=lambda p: int(p.stem.split("-")[-1]))
    result = []
    for f in files:
        with safe_open(str(f), "pt") as handle:
            meta = handle.metadata()
        result.append((load_file(str(f)), meta))
    return result


def _assert_bitwise(got: dict[str, torch.Tensor], want: list[tuple[str, torch.Tensor]]) -> None:
    assert list(got) == [n for n, _ in want] or set(got) == {n for n, _ in want}
    for name, tensor in want:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.dist
def test_buckets_reach_sglangs_own_receiver_bitwise_and_the_group_reconnects(tmp_path):
    import multiprocessing as mp

    try:
        wheel_path()
    except WheelUnavailable as err:
        pytest.skip(str(err))
    outs = [tmp_path / "engine0", tmp_path / "engine1"]
    for o in outs:
        o.mkdir()
    control = tmp_path / "control"
    control.mkdir()
    engines = [_receiver(o, i).start() for i, o in enumerate(outs)]
    worker = None
    try:
        for e in engines:
            e.wait_ready(120)
        (control / "urls-0.json").write_text(json.dumps([e.url for e in engines]))
        worker = mp.get_context("spawn").Process(target=run_workers, args=(_trainer, 1, str(control)))
        worker.start()
        _wait(control / "done-0", engines, worker)
        for o in outs:
            flat = _received(o, "flat")
            assert len(flat) == 2
            _assert_bitwise(flat[0][0], _bucket(1))
            _assert_bitwise(flat[1][0], _bucket(2))
            assert [m["flush_cache"] for _, m in flat] == ["False", "True"]  # once per sync, with the last bucket
            ((per_tensor, _),) = _received(o, "per-tensor")
            _assert_bitwise(per_tensor, _bucket(3))
        engines[1].kill()
        restarted = tmp_path / "engine1-restarted"
        restarted.mkdir()
        engines[1] = _receiver(restarted, 2).start().wait_ready(120)
        outs[1] = restarted
        (control / "urls-1.json").write_text(json.dumps([e.url for e in engines]))
        _wait(control / "done-1", engines, worker)
        worker.join(60)
        assert worker.exitcode == 0
        for o in outs:
            ((after, _),) = _received(o, "after-restart")
            _assert_bitwise(after, _bucket(4))
            ((again, _),) = _received(o, "reconnected")
            _assert_bitwise(again, _bucket(5))
    finally:
        if worker is not None and worker.is_alive():
            worker.kill()
        for e in engines:
            e.stop()
