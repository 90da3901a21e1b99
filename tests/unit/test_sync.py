"""Weight senders' session discipline, without engines: an unaligned flattened bucket fails in
the trainer before any engine is told about it, and the session is ended all the same."""

import asyncio

import pytest
import torch

from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def begin_weight_update(self) -> None:
        self.calls.append("begin")

    async def end_weight_update(self) -> None:
        self.calls.append("end")

    async def update_weights_from_distributed(self, *args, **kwargs) -> None:
        self.calls.append("distributed")

    async def update_weights_from_tensor(self, *args, **kwargs) -> None:
        self.calls.append("tensor")


UNALIGNED = [("norm", torch.zeros(3, dtype=torch.bfloat16)), ("w", torch.zeros(2, 2))]


@pytest.mark.parametrize("kind", ["distributed", "tensor"])
def test_unaligned_bucket_fails_before_the_engine_hears_of_it(kind):
    client = RecordingClient()
    if kind == "distributed":
        sender = DistributedWeightSender([client], [1], "127.0.0.1", 1)
        sender.group = object()  # connected (never used: nothing may be broadcast)
    else:
        sender = TensorWeightSender([client])
    with pytest.raises(ValueError, match="unaligned"):
        asyncio.run(sender.send([UNALIGNED], "1"))
    assert client.calls == ["begin", "end"]
