"""RequestQueue.add: a duplicate id in flight is refused, a finished one's id is free again, and a
burst of arrivals costs id comparisons linear in its size (it scanned every request in flight)."""

import pytest

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.embedded.request_queue import EngineRequest, RequestQueue


class CountingId(str):
    """A request id that counts the equality tests made on it."""

    compared = 0

    def __eq__(self, other):
        CountingId.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def _request(rid: str) -> EngineRequest:
    return EngineRequest(rid=rid, input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))


def test_duplicate_in_flight_is_refused_and_a_finished_id_is_free_again():
    queue = RequestQueue(seed=0, vocab_size=8)
    queue.add(_request("a"))
    queue.admit()
    queue.running.append(queue.waiting.pop(0))  # as the decode loop starts it
    with pytest.raises(ValueError, match="'a' is already in flight"):
        queue.add(_request("a"))
    queue.vacate(0)  # it finished
    queue.add(_request("a"))
    assert [r.rid for r in queue.incoming] == ["a"]


def test_ids_stay_refused_across_pruning():
    queue = RequestQueue(seed=0, vocab_size=8)
    for i in range(300):  # past several prunes; the first 10 stay in flight, the rest leave
        queue.add(_request(f"r{i}"))
        queue.admit()
        if i >= 10:
            queue.waiting.pop()
    for i in range(10):
        with pytest.raises(ValueError, match="already in flight"):
            queue.add(_request(f"r{i}"))
    queue.add(_request("r299"))


def test_a_burst_compares_ids_linearly():
    queue = RequestQueue(seed=0, vocab_size=8)
    CountingId.compared = 0
    for i in range(256):
        queue.add(_request(CountingId(f"rid-{i}")))
    assert CountingId.compared <= 256, CountingId.compared
