"""The vectorised bound search picks exactly what the spec's plain loop picks."""

import itertools
import math

import pytest
import torch

from bapo_megatron.algo.bapo import PRESETS, BAPOConfig, BoundSearch, bapo_preset, search_clip_bounds, search_path
from bapo_megatron.algo.bapo_reference import contributions_at, search_clip_bounds_reference
from bapo_megatron.errors import ConfigError, NonFiniteInputError

PAIRS = list(itertools.product(("loss", "gradient"), ("paper", "lower_first")))


def _random_config(g: torch.Generator, contribution: str, order: str) -> BAPOConfig:
    u = lambda: float(torch.rand((), generator=g))  # noqa: E731
    if u() < 0.5:
        base = {"seed": PRESETS["seed"], "paper": PRESETS["paper"], "verl": PRESETS["verl_example"]}
        cfg = list(base.values())[int(u() * 3)]
        fields = {
            f: getattr(cfg, f) for f in ("low_start", "low_max", "low_step", "high_start", "high_max", "high_step")
        }
    else:
        low_start = 0.3 + 0.6 * u()
        high_start = 1.0 + u()
        fields = dict(
            low_start=low_start,
            low_max=low_start + (1.0 - low_start) * u(),
            low_step=0.005 + 0.1 * u(),
            high_start=high_start,
            high_max=high_start + 2.5 * u(),
            high_step=0.01 + 0.3 * u(),
        )
    target = 0.02 + 0.96 * u() if u() < 0.3 else 0.4 + 0.2 * u()
    return BAPOConfig(
        **fields,
        target_rho=target,
        contribution=contribution,
        search_order=order,
        dual_clip=None if u() < 0.6 else 1.5 + 3 * u(),
    )


def _random_tokens(g: torch.Generator):
    n = int(torch.randint(0, 200, (), generator=g))
    wide = float(torch.rand((), generator=g)) < 0.3
    spread = float(torch.rand((), generator=g)) * (3.0 if wide else 0.8)
    log_ratio = torch.randn(n, generator=g, dtype=torch.float64) * spread
    ratio = torch.exp(log_ratio).to(torch.float32)
    adv_shift = (float(torch.rand((), generator=g)) - 0.5) * (3.0 if wide else 0.6)
    adv = torch.randn(n, generator=g) + adv_shift
    adv[torch.rand(n, generator=g) < 0.1] = 0.0
    mask = (torch.rand(n, generator=g) < 0.85).float()
    return ratio, adv, mask


def _target_on_path(cfg: BAPOConfig, tokens, g: torch.Generator) -> BAPOConfig:
    """The same config with rho0 set to the share at a random point of its path (a mid-path stop)."""
    points = search_path(cfg).points
    c_low, c_high = points[int(torch.randint(len(points), (), generator=g))]
    p, n = contributions_at(*tokens, c_low, c_high, cfg.contribution, cfg.dual_clip)
    rho = 1.0 if p + n <= 0 else p / (p + n)
    return BAPOConfig(**{**cfg.__dict__, "target_rho": min(max(rho, 1e-3), 1 - 1e-3)})


def _assert_same(cfg, ratio, adv, mask):
    fast = search_clip_bounds(ratio, adv, mask, cfg)
    slow = search_clip_bounds_reference(ratio, adv, mask, cfg)
    assert (fast.c_low, fast.c_high, fast.steps) == (slow.c_low, slow.c_high, slow.steps), (cfg, fast, slow)
    assert fast.rho == pytest.approx(slow.rho, rel=1e-12, abs=1e-15)
    assert fast.rho_start == pytest.approx(slow.rho_start, rel=1e-12, abs=1e-15)
    return fast


@pytest.mark.parametrize(("contribution", "order"), PAIRS)
def test_vectorised_search_equals_plain_loop_on_random_data(contribution, order):
    g = torch.Generator().manual_seed(PAIRS.index((contribution, order)))
    stops_first = runs_to_end = in_between = 0
    for i in range(1000):
        cfg = _random_config(g, contribution, order)
        tokens = _random_tokens(g)
        if i % 2:
            cfg = _target_on_path(cfg, tokens, g)
        bounds = _assert_same(cfg, *tokens)
        last = len(search_path(cfg)) - 1
        stops_first += bounds.steps == 0
        runs_to_end += bounds.steps == last
        in_between += 0 < bounds.steps < last
    # The random cases must cover all three outcomes, or the comparison proves little.
    assert stops_first > 50 and runs_to_end > 50 and in_between > 200, (stops_first, runs_to_end, in_between)


@pytest.mark.parametrize(("contribution", "order"), PAIRS)
def test_edge_cases(contribution, order):
    cfg = BAPOConfig(contribution=contribution, search_order=order)
    g = torch.Generator().manual_seed(7)
    ratio = torch.exp(torch.randn(64, generator=g))
    mask = torch.ones(64)
    last = len(search_path(cfg)) - 1
    # All positive: N = 0, rho = 1, the path stops at its first point.
    b = _assert_same(cfg, ratio, torch.rand(64, generator=g) + 0.1, mask)
    assert (b.steps, b.rho, b.rho_start) == (0, 1.0, 1.0)
    # All negative: P = 0, rho = 0 everywhere, the path runs to its end.
    b = _assert_same(cfg, ratio, -torch.rand(64, generator=g) - 0.1, mask)
    assert (b.steps, b.rho) == (last, 0.0)
    assert (b.c_low, b.c_high) == search_path(cfg).points[-1]
    # All advantages zero, and an empty mask: nothing to balance.
    for adv, m in ((torch.zeros(64), mask), (torch.randn(64, generator=g), torch.zeros(64))):
        b = _assert_same(cfg, ratio, adv, m)
        assert (b.steps, b.rho) == (0, 1.0)
    # No tokens at all.
    b = _assert_same(cfg, torch.ones(0), torch.ones(0), torch.ones(0))
    assert b.steps == 0


@pytest.mark.parametrize(("contribution", "order"), PAIRS)
def test_extreme_ratios_and_garbage_at_masked_positions(contribution, order):
    cfg = BAPOConfig(contribution=contribution, search_order=order, target_rho=0.45)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        n = 300
        ratio = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-9), math.log(1e9), generator=g))
        adv = torch.randn(n, generator=g, dtype=torch.float64)
        mask = (torch.rand(n, generator=g) < 0.7).double()
        hidden = mask == 0
        garbage = torch.tensor([math.nan, math.inf, -math.inf, -1.0], dtype=torch.float64).repeat(n)
        ratio[hidden] = garbage[: int(hidden.sum())]
        adv[hidden.nonzero()[::2]] = math.nan
        _assert_same(cfg, ratio, adv, mask)


@pytest.mark.parametrize(("contribution", "order"), PAIRS)
def test_ratios_exactly_on_grid_points(contribution, order):
    """Ties (r == c) are where strict and non-strict comparisons differ."""
    for dual in (None, 2.0):
        cfg = BAPOConfig(contribution=contribution, search_order=order, dual_clip=dual)
        path = search_path(cfg)
        grid = torch.tensor(sorted({*path.low_grid, *path.high_grid, 1.0, 2.0}), dtype=torch.float64)
        g = torch.Generator().manual_seed(11)
        for _ in range(100):
            ratio = grid[torch.randint(len(grid), (120,), generator=g)]
            adv = torch.randn(120, generator=g, dtype=torch.float64)
            cfg_t = BAPOConfig(**{**cfg.__dict__, "target_rho": float(torch.rand((), generator=g)) * 0.9 + 0.05})
            _assert_same(cfg_t, ratio, adv, torch.ones(120))


def test_search_path_lengths_match_the_spec():
    for name, cfg in PRESETS.items():
        path = search_path(cfg)
        if cfg.search_order == "paper":
            k = (
                math.floor((cfg.high_max - cfg.high_start) / cfg.high_step + 1e-9)
                + math.floor((cfg.low_max - cfg.low_start) / cfg.low_step + 1e-9)
                + 1
            )
        else:
            k = (
                math.ceil((cfg.high_max - cfg.high_start) / cfg.high_step - 1e-9)
                + math.ceil((cfg.low_max - cfg.low_start) / cfg.low_step - 1e-9)
                + 1
            )
        assert len(path) == k, name
        assert path.points[0] == (cfg.low_start, cfg.high_start)
    seed = search_path(PRESETS["seed"])
    assert len(seed) == 52
    assert seed.points[36] == (0.6, 3.0) and seed.points[-1] == (0.9, 3.0)  # c_high first, then c_low
    verl = search_path(PRESETS["verl_example"])
    assert verl.points[3] == (0.95, 1.2) and verl.points[-1] == (0.95, 2.0)  # c_low first, then c_high
    # Paper order cannot move at all when c_low has no room, even if c_high has.
    assert len(search_path(BAPOConfig(low_start=0.9, low_max=0.9))) == 1


def test_paper_order_raises_c_high_then_c_low():
    # Off-policy ratios spread wide: a fixed c_high = 1.2 caps the positive tokens while the
    # negative ones count in full, so positives hold only ~34% of the loss at the start.
    cfg = BAPOConfig(target_rho=0.36)
    g = torch.Generator().manual_seed(5)
    ratio = torch.exp(torch.randn(2000, generator=g) * 0.8)
    adv = torch.randn(2000, generator=g) - 0.1
    b = search_clip_bounds(ratio, adv, torch.ones(2000), cfg)
    assert b.rho_start < 0.36 <= b.rho + 1e-9
    assert 0 < b.steps < 36 and b.c_low == cfg.low_start
    assert b.c_high == pytest.approx(cfg.high_start + b.steps * cfg.high_step)


def test_table_accumulates_over_microbatches():
    """Summing per-micro-batch tables equals one search over all tokens (bound_scope 'step')."""
    cfg = BAPOConfig(target_rho=0.55)
    search = BoundSearch(cfg)
    g = torch.Generator().manual_seed(9)
    parts = [(torch.exp(torch.randn(n, generator=g)), torch.randn(n, generator=g), torch.ones(n)) for n in (17, 250, 3)]
    table = sum(search.table(*p) for p in parts)
    whole = [torch.cat(x) for x in zip(*parts, strict=True)]
    split, single = search.select(table), search_clip_bounds(*whole, cfg)
    assert (split.c_low, split.c_high, split.steps) == (single.c_low, single.c_high, single.steps)
    assert split.rho == pytest.approx(single.rho, rel=1e-12)


def test_bad_configs_name_the_field():
    cases = {
        "target_rho": dict(target_rho=1.0),
        "low_start": dict(low_start=0.95),
        "high_start": dict(high_start=3.5),
        "low_step": dict(low_step=0.0),
        "high_step": dict(high_step=-0.1),
        "contribution": dict(contribution="share"),
        "search_order": dict(search_order="upper_first"),
        "bound_scope": dict(bound_scope="global"),
        "dual_clip": dict(dual_clip=0.5),
    }
    for field, kwargs in cases.items():
        with pytest.raises(ConfigError, match=field) as err:
            BAPOConfig(**kwargs)
        assert repr(next(iter(kwargs.values())))[:3] in str(err.value)
    with pytest.raises(ConfigError, match=r"target_rho=-0\.1"):
        BAPOConfig(target_rho=-0.1)
    with pytest.raises(ConfigError, match="preset"):
        bapo_preset("nope")
    assert bapo_preset("paper", dual_clip=3.0).target_rho == 0.4


def test_bad_tensors_are_clear_errors():
    cfg = BAPOConfig()
    with pytest.raises(ValueError, match=r"ratio \(4,\), advantages \(5,\)"):
        search_clip_bounds(torch.ones(4), torch.ones(5), torch.ones(4), cfg)
    ratio = torch.tensor([1.0, math.nan, 1.2, math.inf])
    for fn in (search_clip_bounds, search_clip_bounds_reference):
        with pytest.raises(NonFiniteInputError, match=r"ratio=nan at flat index 1"):
            fn(ratio, torch.ones(4), torch.ones(4), cfg)
        with pytest.raises(NonFiniteInputError, match=r"ratio=-2.0 at flat index 0"):
            fn(torch.tensor([-2.0, 1.0]), torch.ones(2), torch.ones(2), cfg)
        with pytest.raises(NonFiniteInputError, match=r"advantage=inf"):
            fn(torch.ones(2), torch.tensor([1.0, math.inf]), torch.ones(2), cfg)
    # The same NaN at a masked-out position is fine.
    search_clip_bounds(ratio, torch.ones(4), torch.tensor([1.0, 0.0, 1.0, 0.0]), cfg)


def test_search_takes_any_shape_and_dtype():
    g = torch.Generator().manual_seed(2)
    ratio = torch.exp(torch.randn(4, 33, generator=g)).to(torch.bfloat16)
    adv = torch.randn(4, 33, generator=g)
    mask = torch.rand(4, 33, generator=g) < 0.7
    flat = search_clip_bounds(ratio.reshape(-1), adv.reshape(-1), mask.reshape(-1), PRESETS["paper"])
    assert search_clip_bounds(ratio, adv, mask, PRESETS["paper"]) == flat
    assert search_clip_bounds_reference(ratio, adv, mask.float(), PRESETS["paper"]) == flat


def test_verl_example_keeps_the_dual_clip_out_of_the_search_and_in_the_loss():
    """The authors' verl code: the loss caps A < 0 tokens at verl's dual clip c = 3, the bound search
    ignores it. Tokens with A < 0 far past 3 make the two choices differ: the preset's bounds are
    those of a search without the dual clip, and its loss is the capped one at those bounds."""
    import dataclasses

    from bapo_megatron.algo.losses import clipped_surrogate_loss

    g = torch.Generator().manual_seed(3)
    advantages = torch.cat([torch.rand(64, generator=g) + 0.1, -(torch.rand(64, generator=g) + 0.1)])
    ratio = torch.cat([1.0 + 2.0 * torch.rand(64, generator=g), 4.0 + 4.0 * torch.rand(64, generator=g)])
    mask = torch.ones(128)
    preset = PRESETS["verl_example"]
    assert preset.dual_clip == 3.0 and not preset.dual_clip_in_search
    without = search_clip_bounds(ratio, advantages, mask, dataclasses.replace(preset, dual_clip=None))
    got = search_clip_bounds(ratio, advantages, mask, preset)
    counted = search_clip_bounds(ratio, advantages, mask, dataclasses.replace(preset, dual_clip_in_search=True))
    assert (got.c_low, got.c_high, got.rho) == (without.c_low, without.c_high, without.rho)
    assert (counted.c_low, counted.c_high) != (got.c_low, got.c_high)  # the option changes the bounds here
    reference = search_clip_bounds_reference(ratio, advantages, mask, preset)
    assert (reference.c_low, reference.c_high) == (got.c_low, got.c_high)
    loss = clipped_surrogate_loss(ratio, advantages, got.c_low, got.c_high, preset.dual_clip)
    assert torch.equal(loss[64:], -3.0 * advantages[64:])  # every A < 0 token here sits past the cap
