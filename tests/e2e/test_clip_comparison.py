"""The CPU demo runs end to end, and BAPO learns on it with bounds that move."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import clip_comparison


def test_demo_prints_bounds_and_bapo_learns(capsys, tmp_path):
    results = clip_comparison.main(
        ["--losses", "bapo", "ppo", "--steps", "60", "--every", "20", "--json", str(tmp_path / "rows.json")]
    )
    out = capsys.readouterr().out
    assert "c_low" in out and "c_high" in out and "rho" in out
    bapo, ppo = results["bapo"], results["ppo"]
    assert len(bapo) == len(ppo) == 60
    first = sum(r["rollout/reward_mean"] for r in bapo[:8]) / 8
    last = sum(r["rollout/reward_mean"] for r in bapo[-8:]) / 8
    assert last > 2 * first, (first, last)  # it learns
    assert len({r["bapo/clip_high"] for r in bapo}) > 3  # the bounds adapt step to step
    assert {r["bapo/clip_high"] for r in ppo} == {1.2}
    # Where the search moved, it reached the target or ran out of path.
    for r in bapo:
        if r["bapo/search_steps"] > 0:
            assert r["bapo/rho"] >= 0.5 - 1e-9 or (r["bapo/clip_low"], r["bapo/clip_high"]) == (0.9, 3.0)
    assert (tmp_path / "rows.json").stat().st_size > 0
