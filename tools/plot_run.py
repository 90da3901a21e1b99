"""Training-dynamics panels of one or more runs, from their metrics.jsonl, overlaid, to PNG.

    python tools/plot_run.py runs/demo/rl [runs/other ...] --out runs/demo/plots.png

Panels (the BAPO paper's Figure 9, then what this stack adds): reward, policy entropy, the
positive contribution rho, gradient norm, the clip bounds (low dashed), response length,
token staleness and held-out accuracy (eval/*); a panel whose metric no run logged says so.
Then, only where a run logged their metrics: the KL loss, the groups dynamic sampling filtered
out, the experts' load, and the engine-trainer mismatch (rollout_corr/: its KL, NeMo-RL's
token_mult_prob_error for this version's tokens and older ones, the perplexity ratio, the IS weights
and the rejected shares; algo.rollout_correction). A step that trained nothing (no token had an advantage) has no rho
point. Each run is labelled with its directory name (or --labels).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from bapo_megatron.fsutil import read_jsonl
from bapo_megatron.logger import without_placeholders


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    """Its metrics, one line style each (a trailing '*': every metric it starts)."""
    either: bool = False
    """The keys name one figure under the names of several versions: a run's first one logged is drawn."""
    optional: bool = False
    """Drawn only when a run logged one of its metrics (else: 'not logged' in its place)."""


PANELS = [
    Panel("reward", ("rollout/reward_mean", "advantage/reward_mean"), either=True),
    Panel("policy entropy", ("policy/entropy",)),
    Panel("positive contribution rho", ("bapo/rho",)),
    Panel("gradient norm", ("train/grad_norm",)),
    Panel("clip bounds (low dashed)", ("bapo/clip_high", "bapo/clip_low")),
    Panel("response length", ("rollout/response_length",)),
    Panel("token staleness", ("rollout/token_staleness_mean", "rollout/token_staleness_max")),
    Panel("held-out accuracy", ("eval/greedy_acc", "eval/avg@*", "eval/pass@*")),
    Panel("KL loss", ("loss/kl",), optional=True),
    Panel("filtered groups (shortfall dashed)", ("rollout/filtered_groups", "rollout/filter_shortfall"), optional=True),
    Panel("expert load (router disagreement dashed)", ("moe/load_max", "moe/router_disagreement"), optional=True),
    Panel("engine-trainer mismatch: KL (k3 dashed)", ("rollout_corr/kl", "rollout_corr/k3_kl"), optional=True),
    Panel(
        "token_mult_prob_error (older tokens dashed)",
        ("rollout_corr/token_mult_prob_error_same_version", "rollout_corr/token_mult_prob_error_older"),
        optional=True,
    ),
    Panel("perplexity ratio, training / rollout", ("rollout_corr/ppl_ratio",), optional=True),
    Panel(
        "IS weights: mean (out-of-bounds share dashed)",
        ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_oob_ratio"),
        optional=True,
    ),
    Panel(
        "rejected: tokens (sequences dashed)",
        ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_seq_masked_fraction"),
        optional=True,
    ),
]


def read_metrics(run: Path) -> list[dict]:
    """The records of run/metrics.jsonl (or run itself, a jsonl file); ValueError naming a bad line."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"{run}: no metrics.jsonl")
    records = read_jsonl(path, lambda r: None if isinstance(r.get("step"), int) else "a record needs an integer step")
    return [without_placeholders(r) for r in records]  # a log written before the logger left them out


def series(records: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values) for `key`, or every key it matches when it ends with '*'."""
    names = sorted({k for r in records for k in r if k.startswith(key[:-1])}) if key.endswith("*") else [key]
    out = {}
    for name in names:
        points = [(r["step"], r[name]) for r in records if _plottable(r.get(name))]
        if points:
            out[name] = ([s for s, _ in points], [float(v) for _, v in points])
    return out


def panel_series(records: list[dict], panel: Panel) -> list[tuple[int, str, tuple[list[int], list[float]]]]:
    """(the key's index in the panel: its line style, metric name, its series) for each line of `panel`."""
    lines = []
    for k, key in enumerate(panel.keys):
        lines += [(k, name, points) for name, points in series(records, key).items()]
        if panel.either and lines:
            break
    return lines


def _plottable(value) -> bool:
    """A finite number (a logged NaN is null; an infinity, a flag or text has no place on an axis)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


MARKED_BELOW = 50
"""A line of fewer points than this marks each point."""

LEGEND_IN_PANELS = 3
"""More runs than this: one figure legend, not one in each panel."""


def plot(runs: list[Path], out: Path, labels: list[str] | None = None, groups: list[str] | None = None) -> list[str]:
    """Draw every panel into `out`; returns the titles of panels that had data. groups: one name per
    run; runs of a group share a colour and one legend entry (several seeds of a method). Up to
    LEGEND_IN_PANELS lines get a legend in each panel, more one legend for the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    data = [read_metrics(run) for run in runs]
    labels = labels or [run.name if run.is_dir() else run.stem for run in runs]
    groups = groups or labels
    if len(groups) != len(runs):
        raise ValueError(f"{len(groups)} groups for {len(runs)} runs")
    names = list(dict.fromkeys(groups))  # in first-seen order
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {name: colours[i % len(colours)] for i, name in enumerate(names)}
    in_panels = len(runs) <= LEGEND_IN_PANELS
    panels = [p for p in PANELS if not p.optional or any(panel_series(records, p) for records in data)]
    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows + (0 if in_panels else 0.6)), squeeze=False)
    lines = [(records, label, colour[group]) for records, label, group in zip(data, labels, groups, strict=True)]
    drawn = [panel.title for ax, panel in zip(axes.flat, panels, strict=False) if _draw(ax, panel, lines, in_panels)]
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if not in_panels:
        handles = [Line2D([], [], color=colour[name], lw=2) for name in names]
        fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
    else:
        fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def _draw(ax, panel: Panel, lines: list[tuple[list[dict], str, str]], legend: bool) -> bool:
    """Draw `panel` from each (records, label, colour) of `lines`; whether any run had its data."""
    any_data = False
    for records, label, colour in lines:
        for k, name, (steps, values) in panel_series(records, panel):
            style = ("-", "--", ":")[k % 3]  # one colour a run (or group), one line style a metric
            suffix = f" {name.split('/')[-1]}" if len(panel.keys) > 1 and not panel.either else ""
            dots = "o" if len(steps) < MARKED_BELOW else None  # a lone point (rho after steps that trained nothing)
            ax.plot(steps, values, style, marker=dots, ms=2.5, color=colour, label=label + suffix, lw=1.2, alpha=0.85)
            any_data = True
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    if not any_data:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    elif legend:
        ax.legend(fontsize=7)
    return any_data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", type=Path, default=None, help="PNG file (default: FIRST_RUN/plots.png)")
    parser.add_argument("--labels", nargs="+", default=None, help="one legend label per run")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"{len(args.labels)} labels for {len(args.runs)} runs")
    first = args.runs[0]
    out = args.out or ((first if first.is_dir() else first.parent) / "plots.png")
    if not out.parent.is_dir() or out.is_dir():
        why = "a directory" if out.is_dir() else "its directory does not exist"
        print(f"error: --out {out}: {why}", file=sys.stderr)
        return 2
    try:
        drawn = plot(args.runs, out, args.labels)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(drawn)} panels with data)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
