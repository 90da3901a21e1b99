"""The embedded engine's split of a prefill batch against every split of the length-sorted rows."""

import itertools
import random

import pytest

from bapo_megatron.engines.embedded.decode import prefill_chunks


def _cost(lengths, chunks, overhead):
    return sum(overhead + len(c) * max(lengths[i] for i in c) for c in chunks)


@pytest.mark.parametrize("seed", range(20))
def test_split_is_the_cheapest_of_every_contiguous_split(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 20), rng.randint(100, 500)]) for _ in range(rng.randint(1, 9))]
    overhead = rng.choice([0, 16, 64, 256, 10_000])
    chunks = prefill_chunks(lengths, overhead)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))  # every row once
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = min(
        _cost(lengths, [order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))], overhead)
        for k in range(len(order))
        for cuts in itertools.combinations(range(1, len(order)), k)
    )
    assert _cost(lengths, chunks, overhead) == best


def test_short_rows_share_one_forward_and_a_large_overhead_never_splits():
    assert prefill_chunks([6, 7, 5, 6], 64) == [[1, 0, 3, 2]]
    assert len(prefill_chunks([500, 3, 400, 2], 10**6)) == 1
    assert prefill_chunks([], 64) == []
