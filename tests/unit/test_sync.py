"""Weight senders' session discipline, without engines: an unaligned flattened bucket fails in
the trainer before any engine is told about it, and the session is ended all the same; an engine
that refuses to begin leaves no other engine with a session open; the cache is flushed once per
sync, by the last bucket, and not at all in an in-place pause."""

import pytest
import torch

from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender, WeightSendFailed


@pytest.fixture(scope="module")
def loop():
    engine_loop = EngineLoop()
    yield engine_loop
    engine_loop.close()


def _sender(kind: str, clients):
    if kind == "tensor":
        return TensorWeightSender(clients)
    sender = DistributedWeightSender(clients, [1] * len(clients), "127.0.0.1", 1)
    sender.group = object()  # connected (the broadcasts are stubbed where a test needs them)
    sender._broadcast = lambda tensors: None
    return sender


class RecordingClient:
    def __init__(self, refuse_begin: bool = False) -> None:
        self.calls: list[str] = []
        self.refuse_begin = refuse_begin

    async def begin_weight_update(self) -> None:
        if self.refuse_begin:
            raise RuntimeError("engine refused: a session is open already")
        self.calls.append("begin")

    async def end_weight_update(self) -> None:
        self.calls.append("end")

    async def update_weights_from_distributed(self, *args, flush_cache: bool, **kwargs) -> None:
        self.calls.append(f"distributed flush={flush_cache}")

    async def update_weights_from_tensor(self, *args, flush_cache: bool, **kwargs) -> None:
        self.calls.append(f"tensor flush={flush_cache}")


UNALIGNED = [("norm", torch.zeros(3, dtype=torch.bfloat16)), ("w", torch.zeros(2, 2))]


@pytest.mark.parametrize("kind", ["distributed", "tensor"])
def test_unaligned_bucket_fails_before_the_engine_hears_of_it(kind, loop):
    client = RecordingClient()
    sender = _sender(kind, [client])
    with pytest.raises(ValueError, match="unaligned"):
        sender.send([UNALIGNED], "1", loop)
    assert client.calls == ["begin", "end"]


BUCKET = [("w", torch.zeros(2, 2)), ("b", torch.zeros(2))]


@pytest.mark.parametrize("kind", ["distributed", "tensor"])
def test_a_refused_begin_closes_the_sessions_that_opened(kind, loop):
    """(The distributed sender then leaves its group, and says the update failed: the driver sends
    the weights again to whichever engines answer.)"""
    ok, refusing = RecordingClient(), RecordingClient(refuse_begin=True)
    with pytest.raises(WeightSendFailed if kind == "distributed" else RuntimeError, match="refused"):
        _sender(kind, [ok, refusing]).send([BUCKET], "1", loop)
    assert ok.calls[:2] == ["begin", "end"] and "begin" not in refusing.calls


@pytest.mark.parametrize("kind", ["distributed", "tensor"])
def test_the_cache_is_flushed_once_by_the_last_bucket(kind, loop):
    client = RecordingClient()
    _sender(kind, [client]).send(iter([BUCKET, BUCKET, BUCKET]), "1", loop)  # a stream: no len()
    assert client.calls == ["begin", f"{kind} flush=False", f"{kind} flush=False", f"{kind} flush=True", "end"]
    client = RecordingClient()
    _sender(kind, [client]).send(iter([BUCKET, BUCKET]), "2", loop, flush_cache=False)  # in-place: never
    assert client.calls == ["begin", f"{kind} flush=False", f"{kind} flush=False", "end"]


def test_the_group_backend_follows_the_device():
    sender = DistributedWeightSender([RecordingClient()], [1], "127.0.0.1", 1)
    assert sender.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(ValueError, match="backend"):
        DistributedWeightSender([RecordingClient()], [1], "127.0.0.1", 1, backend="mpi")


class OutletClient(RecordingClient):
    """An engine as rank 0's outlet sees it: it takes the weights, reports their version, answers the probe."""

    def __init__(self, events: list[str], answers: bool = True) -> None:
        super().__init__()
        self.calls, self.answers, self.base_url, self.version = events, answers, "http://e", None

    async def update_weights_from_tensor(self, serialized, version, *args, flush_cache: bool) -> None:
        self.calls.append(f"tensor flush={flush_cache}")
        self.version = version

    async def model_info(self) -> dict:
        return {"weight_version": self.version}

    async def generate(self, ids, sampling, rid):
        from bapo_megatron.common.protocol import Completion
        from bapo_megatron.engines.client import EngineUnavailable

        if not self.answers:
            raise EngineUnavailable("gone")
        self.calls.append(f"probe seed={sampling.sampling_seed} tokens={sampling.max_new_tokens}")
        return Completion(rid=rid, output_ids=[4, 5], logprobs=[-0.5, -0.25], finish="length")


def test_rank_0s_outlet_pauses_the_rollout_around_the_send_after_the_readers_and_checks(loop):
    """weights/engine_updates.EngineUpdates is weights/publish.py's outlet on rank 0: what reads the
    old weights finishes first, the rollout is paused only around the send, each engine's version
    is checked; an engine back from a death is `waiting()` until revived; the probe is the first
    prompt's, and an engine that does not answer it is marked dead."""
    import contextlib
    import types

    from bapo_megatron.config import load_config
    from bapo_megatron.engines.fleet import Engines
    from bapo_megatron.engines.pool import EnginePool
    from bapo_megatron.weights.engine_updates import EngineUpdates

    events: list[str] = []
    clients = [OutletClient(events), OutletClient([], answers=False)]  # the first's calls among the events
    pool = EnginePool(clients)
    engines = types.SimpleNamespace(loop=loop, pool=pool, clients=clients)
    engines.check_version = lambda version, members: Engines.check_version(engines, version, members)
    prompts = types.SimpleNamespace(first=lambda n: [([1, 2, 3], {})])
    supervisor = types.SimpleNamespace(restarts=2)

    @contextlib.asynccontextmanager
    async def paused(version: int):
        events.append(f"pause {version}")
        yield
        events.append("resume")

    cfg = load_config(None, ["rollout.engines.colocate=true", "seed=7"])
    updates = EngineUpdates(cfg, engines, supervisor, prompts, paused, lambda: events.append("readers done"))
    pool.came_back(1)  # back from a death: it takes these weights, then waits to be checked
    metrics = updates.publish(iter([BUCKET]), 3)
    assert events == ["readers done", "pause 3", "begin", "tensor flush=True", "end", "resume"]
    assert metrics["engine/live"] == 1 and metrics["engine/restarts"] == 2.0 and metrics["sync/bytes"] > 0
    assert updates.waiting() == [1] and pool.live() == [0] and clients[1].version == "3"
    events.clear()
    assert updates.probe(None).response_ids == [4, 5] and events == ["probe seed=7 tokens=16"]
    assert updates.probe(1) is None and pool.dead == {1}  # did not answer: restarted, probed after its refit
    updates.revive(updates.waiting())  # (dead since: not revived)
    assert pool.live() == [0]
