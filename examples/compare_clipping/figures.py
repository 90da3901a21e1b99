"""The study's figures and summary table, from its results.json (run.py calls draw()).

    python examples/compare_clipping/figures.py runs/compare_clipping

fig2_reward_entropy.png   reward and policy entropy over steps, a column per staleness, a line per
                          method (mean over seeds, min-max shaded): the paper's Fig. 2
fig4_positive_share.png   the positive share of the loss and the negative share of the tokens per
                          method and staleness (mean over steps and seeds, min-max over seeds as
                          error bars), and the share at the first step: the paper's Fig. 4
fig9_bapo_bounds.png      BAPO's bounds and rho over steps at each staleness: the paper's Fig. 9
summary.md                per method and staleness: final held-out greedy accuracy, avg@k, pass@k,
                          entropy and positive share over the last quarter of the steps, the
                          positive share at step 1; mean (min-max) over seeds
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

Record = dict
METHOD_ORDER = ("ppo", "clip_higher", "bapo", "bapo-gradient")


def _order(values, known=()) -> list:
    seen = list(dict.fromkeys(values))
    return [v for v in known if v in seen] + [v for v in seen if v not in known]


def per_step(records: list[Record], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every record logged `key` at, and the mean, min and max over the records there."""
    tables = [{s["step"]: s[key] for s in r["steps"] if s.get(key) is not None} for r in records]
    steps = sorted(set.intersection(*(set(t) for t in tables))) if tables else []
    mean = [statistics.mean(t[s] for t in tables) for s in steps]
    low = [min(t[s] for t in tables) for s in steps]
    high = [max(t[s] for t in tables) for s in steps]
    return steps, mean, low, high


def tail_mean(record: Record, key: str, share: float = 0.25) -> float | None:
    """Mean of `key` over the last `share` of the record's steps (at least one)."""
    values = [s[key] for s in record["steps"] if s.get(key) is not None]
    if not values:
        return None
    return statistics.mean(values[-max(1, round(len(values) * share)) :])


def first(record: Record, key: str) -> float | None:
    return next((s[key] for s in record["steps"] if s.get(key) is not None), None)


def spread(values: list[float | None], fmt: str) -> str:
    """'mean (min-max)' of the values present; '-' when none is."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def groups(runs: list[Record]) -> tuple[list[str], list[str], dict[tuple[str, str], list[Record]]]:
    """Staleness settings and methods in order, and the records of each (staleness, method)."""
    out: dict[tuple[str, str], list[Record]] = {}
    for r in runs:
        out.setdefault((r["staleness"], r["method"]), []).append(r)
    staleness = _order((r["staleness"] for r in runs), ("1", "2", "4", "8", "async4"))
    methods = _order((r["method"] for r in runs), METHOD_ORDER)
    return staleness, methods, out


def summary(study: dict) -> str:
    runs = study["runs"]
    k = study["budget"]["k"]
    staleness, methods, by = groups(runs)
    b = study["budget"]
    lines = [
        f"Task `{study['task']}`; {b['steps']} rollout batches of {b['prompts']} prompts x {b['samples']} samples "
        f"per run; held-out scores on {b['eval_prompts']} prompts after the last step; "
        "mean (min-max) over seeds. Entropy and positive share: mean over the last quarter of the steps.",
        "",
        f"| staleness | method | seeds | greedy acc | avg@{k} | pass@{k} | entropy (end) | positive share (step 1) "
        "| positive share (end) | negative token share (end) | tokens stale (max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in staleness:
        for m in methods:
            rs = by.get((s, m))
            if not rs:
                continue
            stale = [max((x.get("token_staleness_max") or 0) for x in r["steps"]) for r in rs]
            cells = [
                str(len(rs)),
                spread([r["greedy_acc"] for r in rs], ".3f"),
                spread([r[f"avg@{k}"] for r in rs], ".3f"),
                spread([r[f"pass@{k}"] for r in rs], ".3f"),
                spread([tail_mean(r, "entropy") for r in rs], ".3f"),
                spread([first(r, "positive_loss_share") for r in rs], ".3f"),
                spread([tail_mean(r, "positive_loss_share") for r in rs], ".3f"),
                spread([tail_mean(r, "negative_token_share") for r in rs], ".3f"),
                f"{max(stale):g}",
            ]
            lines.append(f"| {s} | {m} | " + " | ".join(cells) + " |")
    starts = [r["greedy_acc_start"] for r in runs if r.get("greedy_acc_start") is not None]
    if starts:
        lines += ["", f"The warm start's held-out greedy accuracy (step 0): {spread(starts, '.3f')}."]
    return "\n".join(lines) + "\n"


def _band(ax, records, key, label, colour):
    steps, mean, low, high = per_step(records, key)
    if not steps:
        return
    ax.plot(steps, mean, label=label, color=colour)
    if len(records) > 1:
        ax.fill_between(steps, low, high, color=colour, alpha=0.15, linewidth=0)


def draw(results: Path, out: Path) -> list[Path]:
    """Write the three figures and summary.md into `out`; returns the figures' paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = json.loads(Path(results).read_text())
    runs = study["runs"]
    if not runs:
        raise ValueError(f"{results}: no runs")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(summary(study))
    staleness, methods, by = groups(runs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {m: colours[i % len(colours)] for i, m in enumerate(methods)}
    title = {s: (f"{s} update{'s' if s != '1' else ''} per batch" if s.isdigit() else "async, K=4") for s in staleness}

    def over_steps(name: str, rows: list[tuple[str, str, list[str]]], suptitle: str) -> Path:
        """A row per (metric, axis label, methods drawn), a column per staleness."""
        fig, axes = plt.subplots(len(rows), len(staleness), figsize=(4 * len(staleness), 3.2 * len(rows) + 0.5))
        axes = [[a] if len(staleness) == 1 else list(a) for a in (axes if len(rows) > 1 else [axes])]
        for j, s in enumerate(staleness):
            for i, (key, label, drawn) in enumerate(rows):
                for m in drawn:
                    if (s, m) in by:
                        _band(axes[i][j], by[(s, m)], key, m, colour[m])
                axes[i][0].set_ylabel(label)
            axes[0][j].set_title(title[s])
            axes[-1][j].set_xlabel("step")
        axes[0][-1].legend(fontsize=8)
        fig.suptitle(suptitle + " (mean over seeds, min-max shaded)")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    fig2 = over_steps(
        "fig2_reward_entropy.png",
        [("reward", "reward (mean)", methods), ("entropy", "policy entropy", methods)],
        "Reward and entropy under staleness",
    )

    # Fig. 4: positive share of the loss, negative share of the tokens
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(methods)
    panels = (
        ("positive share of the loss (all steps)", lambda r: tail_mean(r, "positive_loss_share", 1.0)),
        ("positive share of the loss (step 1)", lambda r: first(r, "positive_loss_share")),
        ("negative share of the tokens (all steps)", lambda r: tail_mean(r, "negative_token_share", 1.0)),
    )
    for ax, (name, value) in zip(axes, panels, strict=True):
        for i, m in enumerate(methods):
            xs, ys, err = [], [], [[], []]
            for j, s in enumerate(staleness):
                vals = [v for v in (value(r) for r in by.get((s, m), [])) if v is not None]
                if vals:
                    mean = statistics.mean(vals)
                    xs.append(j + (i - (len(methods) - 1) / 2) * width)
                    ys.append(mean)
                    err[0].append(mean - min(vals))
                    err[1].append(max(vals) - mean)
            ax.bar(xs, ys, width, yerr=err, label=m, color=colour[m], capsize=2)
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xticks(range(len(staleness)), [title[s] for s in staleness], rotation=20, fontsize=8)
        ax.set_title(name)
        ax.set_ylim(0.3, 0.7)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig4 = out / "fig4_positive_share.png"
    fig.savefig(fig4, dpi=110)
    plt.close(fig)

    bapo = [m for m in methods if m.startswith("bapo")]
    fig9 = over_steps(
        "fig9_bapo_bounds.png",
        [
            ("positive_loss_share", "positive share of the loss", methods),
            ("clip_high", "BAPO c_high", bapo),
            ("clip_low", "BAPO c_low", bapo),
        ],
        "BAPO's bounds and the positive share over steps",
    )
    return [fig2, fig4, fig9]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: figures.py OUT   (the study's directory, holding results.json)")
    where = Path(sys.argv[1])
    print("\n".join(str(p) for p in draw(where / "results.json", where)))
