"""BAPO's adaptive clip-bound search (docs/BAPO_SPEC.md), one pass and one all-reduce per search.

The search walks a path of (c_low, c_high) points that is fixed by the config, so the
positive and negative contributions P and N of every point can be computed in one pass
over the tokens: each token's ratio is bucketed against the (ascending) grids of lower
and upper bounds, per-bucket sums are prefix-summed, and the [K, 2] table of (P, N) is
reduced once over the data-parallel group. The first point whose share
rho = P / (P + N) meets the target is the answer, exactly what the plain loop picks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from bapo_megatron.errors import NonFiniteInputError, check

TOL = 1e-9
"""Tolerance of every bound and target comparison: 0.6 + 15 * 0.02 reaches 0.9."""

CHUNK_TOKENS = 1 << 20
"""Tokens per pass of the one-pass statistics: bounds the float64 temporaries."""

Contribution = Literal["loss", "gradient"]
SearchOrder = Literal["paper", "lower_first"]
BoundScope = Literal["step", "microbatch"]


@dataclass(frozen=True, kw_only=True)
class BAPOConfig:
    """Parameters of BAPO's bound search (Algorithm 1 of the paper), defaults from the seed README."""

    target_rho: float = 0.5
    """rho0: the share P / (P + N) of the loss that positive-advantage tokens must reach."""
    low_start: float = 0.6
    """a_low: the lower bound c_low starts here (an absolute ratio, not 1 - eps)."""
    low_max: float = 0.9
    """b_low: c_low never moves past this."""
    low_step: float = 0.02
    """delta2: how far c_low moves per search step."""
    high_start: float = 1.2
    """a_high: the upper bound c_high starts here."""
    high_max: float = 3.0
    """b_high: c_high never moves past this."""
    high_step: float = 0.05
    """delta1: how far c_high moves per search step."""
    contribution: Contribution = "loss"
    """"loss": shares of the clipped surrogate (Eq. 8); "gradient": only tokens the bounds let through."""
    search_order: SearchOrder = "paper"
    """"paper": raise c_high first, then c_low (Algorithm 1); "lower_first": the authors' verl code."""
    bound_scope: BoundScope = "step"
    """"step": one search over the whole optimizer step; "microbatch": one per micro-batch (verl)."""
    dual_clip: float | None = None
    """For A < 0, cap the per-token loss at -dual_clip * A (None: no cap). Enters N as the loss does."""
    dual_clip_in_search: bool = True
    """Whether the search's N counts the dual clip's cap as the loss does (the spec), or leaves it
    out (False), as the authors' verl code does: its loss applies verl's dual clip (c = 3) while
    its bound search ignores it."""

    def __post_init__(self) -> None:
        check(0.0 < self.target_rho < 1.0, "target_rho", self.target_rho, "must lie in (0, 1)")
        for name in ("low_start", "low_max", "low_step", "high_start", "high_max", "high_step"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0.0, name, value, "must be a positive finite number")
        check(
            self.low_start <= self.low_max,
            "low_start",
            self.low_start,
            f"must not exceed low_max={self.low_max} (inverted range)",
        )
        check(
            self.high_start <= self.high_max,
            "high_start",
            self.high_start,
            f"must not exceed high_max={self.high_max} (inverted range)",
        )
        check(self.low_max <= 1.0, "low_max", self.low_max, "a lower ratio bound must be <= 1")
        check(self.high_start >= 1.0, "high_start", self.high_start, "an upper ratio bound must be >= 1")
        check(
            self.contribution in ("loss", "gradient"), "contribution", self.contribution, "must be 'loss' or 'gradient'"
        )
        check(
            self.search_order in ("paper", "lower_first"),
            "search_order",
            self.search_order,
            "must be 'paper' or 'lower_first'",
        )
        check(
            self.bound_scope in ("step", "microbatch"),
            "bound_scope",
            self.bound_scope,
            "must be 'step' or 'microbatch'",
        )
        if self.dual_clip is not None:
            check(
                math.isfinite(self.dual_clip) and self.dual_clip > 1.0,
                "dual_clip",
                self.dual_clip,
                "must be None or a finite number > 1",
            )

    @property
    def search_dual_clip(self) -> float | None:
        """The dual clip the bound search sees (None: none)."""
        return self.dual_clip if self.dual_clip_in_search else None


def target_from_pn_ratio(pn: float) -> float:
    """The share target rho0 that a P/N target (as the verl code states it) means."""
    return pn / (1.0 + pn)


PRESETS: dict[str, BAPOConfig] = {
    "seed": BAPOConfig(),
    "paper": BAPOConfig(target_rho=0.4),
    "verl_example": BAPOConfig(
        target_rho=target_from_pn_ratio(0.5),
        low_start=0.8,
        low_max=0.95,
        low_step=0.05,
        high_start=1.2,
        high_max=2.0,
        high_step=0.1,
        search_order="lower_first",
        bound_scope="microbatch",
        dual_clip=3.0,
        dual_clip_in_search=False,
    ),
}
"""Named parameter sets: the seed README (default), the paper's section 5.1 runs, the authors' verl example."""


def bapo_preset(name: str, **overrides: object) -> BAPOConfig:
    """A named preset, with any field overridden."""
    check(name in PRESETS, "preset", name, f"must be one of {sorted(PRESETS)}")
    fields = {f: getattr(PRESETS[name], f) for f in BAPOConfig.__dataclass_fields__}
    return BAPOConfig(**{**fields, **overrides})


# ----------------------------------------------------------------------------------------------
# The search path: the plain loop of the spec, with the stopping test supplied by the caller.


def walk(config: BAPOConfig, meets: Callable[[float, float], bool]) -> list[tuple[float, float]]:
    """Every (c_low, c_high) the spec's loop visits, in order; the last one is its answer.

    Bounds are recomputed from step counts (a + i * d, rounded to 12 decimals) rather than
    accumulated, so that the path, the vectorised search and the reference loop all hold
    bitwise the same floats, and 0.6 + 15 * 0.02 reads 0.9.
    """
    a_low, b_low, d_low = config.low_start, config.low_max, config.low_step
    a_high, b_high, d_high = config.high_start, config.high_max, config.high_step
    i_low = i_high = 0
    c_low, c_high = a_low, a_high
    visited = [(c_low, c_high)]
    if config.search_order == "paper":
        while not meets(c_low, c_high) and c_low + d_low <= b_low + TOL:
            if c_high + d_high <= b_high + TOL:
                i_high += 1
                c_high = round(a_high + i_high * d_high, 12)
            else:
                i_low += 1
                c_low = round(a_low + i_low * d_low, 12)
            visited.append((c_low, c_high))
        return visited
    while not meets(c_low, c_high) and c_low < b_low - TOL:
        i_low += 1
        c_low = min(round(a_low + i_low * d_low, 12), b_low)
        visited.append((c_low, c_high))
    while not meets(c_low, c_high) and c_high < b_high - TOL:
        i_high += 1
        c_high = min(round(a_high + i_high * d_high, 12), b_high)
        visited.append((c_low, c_high))
    return visited


@dataclass(frozen=True)
class SearchPath:
    """The K points the search may visit, and the ascending grids of distinct lower/upper bounds."""

    points: tuple[tuple[float, float], ...]
    low_grid: tuple[float, ...]
    high_grid: tuple[float, ...]
    low_index: tuple[int, ...] = field(repr=False)
    high_index: tuple[int, ...] = field(repr=False)

    def __len__(self) -> int:
        return len(self.points)


def search_path(config: BAPOConfig) -> SearchPath:
    """The full path of `config` (the loop never stopping early); its length is K of the spec."""
    points = tuple(walk(config, lambda c_low, c_high: False))
    low_grid = tuple(sorted({p[0] for p in points}))
    high_grid = tuple(sorted({p[1] for p in points}))
    return SearchPath(
        points=points,
        low_grid=low_grid,
        high_grid=high_grid,
        low_index=tuple(low_grid.index(p[0]) for p in points),
        high_index=tuple(high_grid.index(p[1]) for p in points),
    )


# ----------------------------------------------------------------------------------------------
# One pass over the tokens: P for every upper bound, N for every lower bound.


def check_shapes(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> None:
    if ratio.shape != advantages.shape or ratio.shape != mask.shape:
        raise ValueError(
            f"ratio, advantages and mask must have one shape; got ratio {tuple(ratio.shape)}, "
            f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}"
        )


def _sanitise(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor):
    """float64 (ratio, advantage, weight) with masked-out and invalid tokens neutralised.

    Also returns how many counted tokens had an invalid ratio (non-finite or negative) and an
    invalid advantage or weight, so that every rank can raise after the one reduction.
    """
    weight = mask.to(torch.float64)
    counted = weight != 0
    r = ratio.to(torch.float64)
    a = advantages.to(torch.float64)
    bad_ratio = counted & ~(torch.isfinite(r) & (r >= 0))
    bad_other = counted & ~(torch.isfinite(a) & torch.isfinite(weight) & (weight > 0))
    keep = counted & ~bad_ratio & ~bad_other
    weight = torch.where(keep, weight, 0.0)
    r = torch.where(keep, r, 1.0)
    a = torch.where(keep, a, 0.0)
    return r, a, weight, bad_ratio.sum(), bad_other.sum()


def _bucket_sums(r: torch.Tensor, w: torch.Tensor, grid: torch.Tensor, right: bool):
    """Per-bucket sums of w * r and w, buckets given by searchsorted(grid, r, right)."""
    idx = torch.searchsorted(grid, r, right=right)
    sum_wr = torch.zeros(len(grid) + 1, dtype=torch.float64, device=r.device)
    sum_w = torch.zeros_like(sum_wr)
    sum_wr.index_add_(0, idx, w * r)
    sum_w.index_add_(0, idx, w)
    return sum_wr, sum_w


def _tail(x: torch.Tensor) -> torch.Tensor:
    """tail[j] = sum(x[j:]), without the cancellation of total - cumsum."""
    return x.flip(0).cumsum(0).flip(0)


def contribution_sums(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    low_grid: torch.Tensor,
    high_grid: torch.Tensor,
    contribution: Contribution,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local P at every upper bound and N at every lower bound, in one chunked pass.

    Args:
        ratio, advantages, mask: same shape; mask weights the tokens (0: not counted).
        low_grid, high_grid: ascending float64 bounds on the tokens' device.
    Returns:
        P [len(high_grid)], N [len(low_grid)], and counts [4] = (invalid ratios, invalid
        advantages or weights, counted weight, counted tokens), all float64, no collective.
    """
    check_shapes(ratio, advantages, mask)
    device = ratio.device
    pos_r, pos_w = (torch.zeros(len(high_grid) + 1, dtype=torch.float64, device=device) for _ in range(2))
    neg_r, neg_w = (torch.zeros(len(low_grid) + 1, dtype=torch.float64, device=device) for _ in range(2))
    capped = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(4, dtype=torch.float64, device=device)
    flat = [t.reshape(-1) for t in (ratio, advantages, mask)]
    for start in range(0, flat[0].numel(), CHUNK_TOKENS):
        r, a, w, bad_r, bad_a = _sanitise(*(t[start : start + CHUNK_TOKENS] for t in flat))
        counts += torch.stack([bad_r.to(counts), bad_a.to(counts), w.sum(), (w != 0).sum().to(counts)])
        w_pos = w * a.clamp(min=0)
        w_neg = w * (-a).clamp(min=0)
        if dual_clip is not None:
            # Tokens at or past the dual clip add a constant dual_clip * |A| to the loss and no gradient.
            over = r >= dual_clip
            capped += torch.where(over, w_neg, 0.0).sum() * dual_clip
            w_neg = torch.where(over, 0.0, w_neg)
        # Upper bounds: bucket i holds tokens with high_grid[i-1] <= r < high_grid[i].
        sr, sw = _bucket_sums(r, w_pos, high_grid, right=True)
        pos_r += sr
        pos_w += sw
        # Lower bounds: bucket i holds tokens with low_grid[i-1] < r <= low_grid[i].
        sr, sw = _bucket_sums(r, w_neg, low_grid, right=False)
        neg_r += sr
        neg_w += sw
    below_high = pos_r.cumsum(0)[:-1]  # sum of w r over tokens with r < c_high
    above_low = _tail(neg_r)[1:]  # sum of w r over tokens with r > c_low
    if contribution == "gradient":
        return below_high, above_low, counts
    p = below_high + high_grid * _tail(pos_w)[1:]  # A * min(r, c_high)
    n = above_low + low_grid * neg_w.cumsum(0)[:-1] + capped  # |A| * min(max(r, c_low), dual)
    return p, n, counts


# ----------------------------------------------------------------------------------------------
# Choosing the bounds.


@dataclass(frozen=True)
class ClipBounds:
    """The bounds a search chose and what it saw; identical on every rank of the group."""

    c_low: float
    c_high: float
    rho: float
    """P / (P + N) at the chosen bounds (1 when P + N = 0)."""
    rho_start: float
    """P / (P + N) at the start of the path (low_start, high_start)."""
    steps: int
    """How many search steps were taken (0: the starting bounds were kept)."""

    def metrics(self) -> dict[str, float]:
        return {
            "bapo/clip_low": self.c_low,
            "bapo/clip_high": self.c_high,
            "bapo/rho": self.rho,
            "bapo/rho_start": self.rho_start,
            "bapo/search_steps": float(self.steps),
        }


def _share(p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    total = p + n
    return torch.where(total > 0, p / torch.where(total > 0, total, 1.0), 1.0)


class BoundSearch:
    """The search of one config, split so that callers can accumulate statistics.

    `table` gives a rank's [K + 1, 2] partial table for some tokens; tables of several
    micro-batches add up; `select` reduces the sum with one all-reduce over `group` and
    picks the bounds. `search_clip_bounds` is both in one call.
    """

    def __init__(self, config: BAPOConfig) -> None:
        self.config = config
        self.path = search_path(config)
        self._grids: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _device_grids(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._grids:
            p = self.path
            self._grids[device] = tuple(
                torch.tensor(x, dtype=dtype, device=device)
                for x, dtype in (
                    (p.low_grid, torch.float64),
                    (p.high_grid, torch.float64),
                    (p.low_index, torch.long),
                    (p.high_index, torch.long),
                )
            )
        return self._grids[device]

    def table(self, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Rows 0..K-1: (P, N) at each path point; row K: (invalid ratios, invalid advantages/weights)."""
        low, high, low_index, high_index = self._device_grids(ratio.device)
        cfg = self.config
        p, n, counts = contribution_sums(ratio, advantages, mask, low, high, cfg.contribution, cfg.search_dual_clip)
        return torch.cat([torch.stack([p[high_index], n[low_index]], dim=1), counts[:2].view(1, 2)])

    def select(self, table: torch.Tensor, group: dist.ProcessGroup | None = None) -> ClipBounds:
        """Reduce `table` (one all-reduce over `group`; None: none) and pick the first point that meets rho0."""
        if group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
        rho = _share(table[:-1, 0], table[:-1, 1])
        meets = rho >= self.config.target_rho - TOL
        last = len(self.path) - 1
        index = torch.where(meets.any(), meets.to(torch.uint8).argmax(), last)
        bad_ratio, bad_other, chosen, rho_chosen, rho_start = torch.stack(
            [table[-1, 0], table[-1, 1], index.to(rho), rho.gather(0, index.view(1))[0], rho[0]]
        ).tolist()  # the search's only host synchronisation (rho[index] would read index first)
        if bad_ratio or bad_other:
            raise NonFiniteInputError(
                f"BAPO bound search: {int(bad_ratio)} counted tokens have a non-finite or negative "
                f"ratio and {int(bad_other)} a non-finite advantage or invalid mask weight "
                f"(summed over the group); masked-out tokens may hold anything"
            )
        c_low, c_high = self.path.points[int(chosen)]
        return ClipBounds(c_low=c_low, c_high=c_high, rho=rho_chosen, rho_start=rho_start, steps=int(chosen))

    def __call__(self, ratio, advantages, mask, group: dist.ProcessGroup | None = None) -> ClipBounds:
        try:
            return self.select(self.table(ratio, advantages, mask), group)
        except NonFiniteInputError as err:
            raise NonFiniteInputError(f"{err}{first_invalid(ratio, advantages, mask)}") from None


def first_invalid(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> str:
    """Where this rank's first invalid counted token is, for the error message (error path only)."""
    counted = mask.reshape(-1) != 0
    checks = (
        ("ratio", ratio.reshape(-1), lambda x: torch.isfinite(x) & (x >= 0)),
        ("advantage", advantages.reshape(-1), torch.isfinite),
        ("mask weight", mask.reshape(-1).double(), lambda x: torch.isfinite(x) & (x >= 0)),
    )
    for name, values, valid in checks:
        bad = (counted & ~valid(values)).nonzero()
        if len(bad):
            i = int(bad[0])
            return f"; here the first is {name}={values[i].item()!r} at flat index {i}"
    return ""


_SEARCHES: dict[BAPOConfig, BoundSearch] = {}


def search_clip_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: BAPOConfig,
    group: dist.ProcessGroup | None = None,
) -> ClipBounds:
    """BAPO's bounds for these tokens (and those of every rank in `group`), vectorised.

    Args:
        ratio: r_t = pi / mu per token, any shape (detached; it selects bounds only).
        advantages: A_t, same shape.
        mask: m_t, same shape: 1 (or a positive weight) for counted tokens, 0 otherwise;
            masked-out tokens may hold NaN or inf.
        config: the search parameters.
        group: the data-parallel (x context-parallel) group to sum statistics over, with
            exactly one all-reduce; None: this process's tokens alone, no collective.
    Raises:
        ValueError on mismatched shapes; NonFiniteInputError (a ValueError) when a counted
        token has a non-finite or negative ratio or a non-finite advantage.
    """
    if config not in _SEARCHES:
        _SEARCHES[config] = BoundSearch(config)
    return _SEARCHES[config](ratio, advantages, mask, group)
