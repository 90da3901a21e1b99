"""Test tiers: each directory's tests carry its marker; gpu tests skip without CUDA."""

from pathlib import Path

import pytest
import torch

TIERS = ("unit", "dist", "gpu", "e2e")


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs CUDA (tests/gpu run on an H100/H200; this machine has none)")
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def wheel():
    """SGLang 0.5.23's wheel (tests/sglang_wheel.py: downloaded once into the cache), opened; the test
    skips, saying why, where the registry cannot be reached."""
    import zipfile

    from tests.sglang_wheel import WheelUnavailable, wheel_path

    try:
        return zipfile.ZipFile(wheel_path())
    except WheelUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """hf_model(name, case=None): tests/helpers.make_hf_model's random HF directory (weights, tokenizer),
    built once a session and shared: read it, copy it to change it."""
    from tests.helpers import make_hf_model

    root, built = tmp_path_factory.mktemp("hf-models"), {}

    def get(name: str, case: tuple[str, int, bool] | None = None) -> Path:
        if name not in built:
            make_hf_model(root, name, case)
            built[name] = (case, root / name)
        assert built[name][0] == case, f"{name} was built as {built[name][0]}, asked as {case}"
        return built[name][1]

    return get


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    """A `bapo-train` run that a failed test left running (tests/online.start) is killed after it:
    it would hold a core and its ports for the rest of the suite."""
    yield
    import sys

    online = sys.modules.get("tests.online")
    if online is not None:
        online.kill_leftovers()


RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_world_left_behind():
    """A command run in pytest's process (train.run, hf_to_mcore, verify) makes a world of one there:
    rendezvous variables and a process group whose store holds MASTER_PORT. Undone after the test, or
    every later bapo-train subprocess inherits RANK and a port this process holds (EADDRINUSE) and
    in-process reductions see a group."""
    import os

    before = {k: os.environ.get(k) for k in RENDEZVOUS}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from bapo_megatron.trainer.parallel import destroy_model_parallel

        destroy_model_parallel()  # the groups Megatron made, if any
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
