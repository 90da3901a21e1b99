"""The presets' docs say what the dry run says: every figure of a preset's README and of its Slurm
script's header that a dry run can check is checked here, by running that dry run.

A doc holds transcripts, a `$ bapo-train ... --dry-run` line and below it lines of what the dry run
prints, in the order it prints them (`...` stands for what a line leaves out; `error: ...` for a
refusal). In a README they sit in a fenced block; in a Slurm script's header they are comment
lines, indented alike. Each transcript is run here (in-process, as `bapo-train` runs it from the
checkout) and compared. The prose around them, and the comments of the preset's YAML files, may give
figures too, but only ones the doc's dry runs print: memory (GiB, MiB), recompute (layers, step
compute), layouts (TP x PP x EP x DP), processes, nodes, expert data parallel, mem_fraction_static.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.parent for p in ROOT.glob("examples/*/config.yaml") if (p.parent / "README.md").exists())
SCRIPTS = sorted(s for s in ROOT.glob("slurm/bapo_*.sh") if re.search(r"^bapo_gpu_job ", s.read_text(), re.M))
DOCS = [p / "README.md" for p in PRESETS] + SCRIPTS
COMMAND = re.compile(r"^(\s*)\$ bapo-train (.*--dry-run.*)$")
ELIDED = re.compile(r"\s*\.\.\.\s*")  # with the spaces around it: "GPUs ..." is "GPUs; the ..."


@dataclass(frozen=True)
class Transcript:
    """One `$ bapo-train ... --dry-run` of a doc and the lines it says the dry run prints."""

    doc: str
    line: int
    argv: tuple[str, ...]
    printed: tuple[str, ...]


def doc_lines(doc: Path) -> list[str]:
    """The lines that make claims: a README's all, a Slurm script's header comment (# taken off)."""
    lines = doc.read_text().splitlines()
    if doc.suffix != ".sh":
        return lines
    header = []
    for line in lines[1:]:  # after the shebang, up to the #SBATCH options
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        header.append(line[2:] if line.startswith("# ") else line[1:])
    return header


def transcripts(doc: Path, lines: list[str] | None = None) -> list[Transcript]:
    lines = doc_lines(doc) if lines is None else lines
    found = []
    for i, line in enumerate(lines):
        command = COMMAND.match(line)
        if command is None:
            continue
        indent, printed = command.group(1), []
        for below in lines[i + 1 :]:
            if not below.startswith(indent) or not below.strip() or below.lstrip().startswith(("$ ", "```")):
                break
            printed.append(below[len(indent) :])
        found.append(Transcript(doc.name, i + 1, tuple(shlex.split(command.group(2))), tuple(printed)))
    return found


def prose(doc: Path) -> str:
    """The doc's claims less its transcripts (whose figures the comparison checks)."""
    lines = doc_lines(doc)
    skip = set()
    for t in transcripts(doc, lines):
        skip.update(range(t.line - 1, t.line + len(t.printed)))
    return "\n".join(line for i, line in enumerate(lines) if i not in skip)


def unmatched(printed: tuple[str, ...], out: list[str]) -> str | None:
    """The first of `printed` not found in `out` after the one before it, or None."""
    at = 0
    for want in printed:
        for i in range(at, len(out)):
            if re.fullmatch(".*".join(map(re.escape, ELIDED.split(want))), out[i]):
                at = i + 1
                break
        else:
            return want
    return None


@pytest.fixture(scope="module")
def dry_run() -> Iterator[Callable[[tuple[str, ...]], tuple[int, list[str]]]]:
    """`bapo-train ARGV` in-process from the checkout, as a user runs it there (no $WORLD_SIZE, no
    $BAPO_HOME): its exit code and its stdout and stderr lines; each command is run once."""
    from bapo_megatron.train import main

    done: dict[tuple[str, ...], tuple[int, list[str]]] = {}

    def run(argv: tuple[str, ...]) -> tuple[int, list[str]]:
        if argv not in done:
            out, err, code = io.StringIO(), io.StringIO(), 0
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    main(list(argv))
                except SystemExit as stop:
                    code = stop.code
            done[argv] = (code, (out.getvalue() + err.getvalue()).splitlines())
        return done[argv]

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        patch.delenv("WORLD_SIZE", raising=False)
        patch.delenv("BAPO_HOME", raising=False)
        yield run


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_each_doc_holds_the_dry_run_of_the_config_it_is_about(doc):
    """A README: of its preset's config.yaml; a Slurm script: of its default CONFIG, as it runs it."""
    if doc.suffix == ".sh":
        config = re.search(r"^CONFIG=\$\{CONFIG:-(\S+?)\}", doc.read_text(), re.M).group(1)
    else:
        config = _name(doc.parent / "config.yaml")
    commands = {t.argv for t in transcripts(doc)}
    assert (config, "--dry-run") in commands, f"{_name(doc)}: no `$ bapo-train {config} --dry-run`"


def compare(t: Transcript, dry_run: Callable) -> str | None:
    """How the dry run differs from the transcript `t`, or None: a refusal where it says the plan
    fits (or the other way round), a line it does not print."""
    code, out = dry_run(t.argv)
    where = f"{t.doc}:{t.line} $ bapo-train {shlex.join(t.argv)}"
    if any(line.startswith("error:") for line in t.printed) != (code != 0):
        return f"{where}: exit {code}\n" + "\n".join(out[-3:])
    missing = unmatched(t.printed, out)
    return None if missing is None else f"{where}: the dry run does not print (or not in this order):\n{missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_the_transcripts_are_what_the_dry_run_prints(doc, dry_run):
    differ = [d for d in (compare(t, dry_run) for t in transcripts(doc)) if d is not None]
    assert not differ, "\n\n".join(differ)


FIGURES = {  # a figure of the prose: how the dry run prints it
    r"(\d[\d,]*(?:\.\d+)?) (GiB|MiB)": lambda n, unit: rf"(?<![\d.,]){re.escape(n)} {unit}",
    r"\+(\d+)%": lambda n: rf"\+{n}%",
    r"\b(\d+) of (?:the |each stage's |a stage's |its )?(\d+) layers": lambda a, b: rf"\b{a} of (?:the )?{b} layers",
    r"\b(\d+) (?:trainer )?processes\b": lambda n: rf"\b{n} (?:trainer )?processes\b",
    r"\b(\d+) (trainer|rollout) nodes?\b": lambda n, kind: rf"\b{n} {kind} node\(s\)",
    r"mem_fraction_static`? (\d\.\d+)": lambda n: rf"mem_fraction_static {re.escape(n)}\b",
    r"expert data\s+parallel (\d+)": lambda n: rf"expert data parallel {n}\b",
}
DEEPSEEK_V3 = 671e9  # parameters (its card): the Moonlight README says why no preset lays it out
BY_HAND = {  # figures of a model no preset lays out, so no dry run prints: their arithmetic instead
    "examples/moonlight-16b-a3b/README.md": {
        "11,249 GiB": DEEPSEEK_V3 * 18 / 2**30,  # bf16 weights, fp32 gradients, main copy and 2 moments
        "1,250 GiB": DEEPSEEK_V3 * 2 / 2**30,  # its bf16 weights
    }
}
LAYOUT = re.compile(r"\bTP \d+(?: x (?:PP|EP|DP|CP) \d+)*")


def _layout(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(TP|PP|EP|DP|CP) (\d+)", text)}


def unprinted(text: str, printed: str) -> list[str]:
    """The figures of `text` that `printed` (a doc's dry runs, all lines) does not hold; a layout is
    held when one the dry runs print has its sizes (the prose may leave out PP 1)."""
    missing = [
        m.group(0)
        for pattern, said in FIGURES.items()
        for m in re.finditer(pattern, text)
        if not re.search(said(*m.groups()), printed)
    ]
    layouts = [_layout(m.group(0)) for m in LAYOUT.finditer(printed)]
    for m in LAYOUT.finditer(text):
        want = _layout(m.group(0))
        if not any(want.items() <= got.items() for got in layouts):
            missing.append(m.group(0))
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_the_figures_of_the_prose_are_the_dry_runs(doc, dry_run):
    printed = "\n".join(line for t in transcripts(doc) for line in dry_run(t.argv)[1])
    by_hand = BY_HAND.get(_name(doc), {})
    for figure, value in by_hand.items():
        assert figure == f"{value:,.0f} GiB" and figure in prose(doc), (figure, value)
    missing = [figure for figure in unprinted(prose(doc), printed) if figure not in by_hand]
    assert missing == [], f"{_name(doc)}: figures that no transcript of it prints: {missing}"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda preset: preset.name)
def test_the_figures_of_a_presets_yaml_comments_are_its_readmes_dry_runs(preset, dry_run):
    """config.yaml, recipe.yaml, long.yaml: their comments say why a field is set, with figures the
    README's dry runs print."""
    printed = "\n".join(line for t in transcripts(preset / "README.md") for line in dry_run(t.argv)[1])
    for config in sorted(preset.glob("*.yaml")):
        comments = "\n".join(line.split("#", 1)[1] for line in config.read_text().splitlines() if "#" in line)
        missing = unprinted(comments, printed)
        assert missing == [], f"{_name(config)}: figures that no transcript of its README prints: {missing}"


def test_the_checks_find_a_wrong_claim(tmp_path, dry_run):
    """A claim the tool refuses (the 30B-A3B preset on 2 trainer nodes, as its docs once said)
    fails the comparison; a figure of the prose no dry run prints is found, one it prints is not."""
    doc = tmp_path / "README.md"
    doc.write_text(
        "```console\n$ bapo-train examples/qwen3-30b-a3b/config.yaml --dry-run --world-size 16\n"
        "trainer: 16 processes, TP 4 x PP 1 x EP 8 x DP 4\n```\nTRAIN_NODES=2 fits: 74 GiB, TP 1 x EP 8.\n"
    )
    (t,) = transcripts(doc)
    assert t.argv == ("examples/qwen3-30b-a3b/config.yaml", "--dry-run", "--world-size", "16")
    assert t.printed == ("trainer: 16 processes, TP 4 x PP 1 x EP 8 x DP 4",)
    assert "examples/qwen3-30b-a3b/config.yaml --dry-run --world-size 16: exit 2" in compare(t, dry_run)
    assert "74.1 GiB a GPU, more than the 73.0 GiB usable" in compare(t, dry_run)
    fits = Transcript(t.doc, t.line, (*t.argv, "parallel.recompute=auto"), t.printed)
    assert compare(fits, dry_run) is None
    printed = "peak is 74.1 GiB a GPU\ntrainer: 32 processes, TP 4 x PP 1 x EP 8 x DP 8"
    assert unprinted(prose(doc), printed) == ["74 GiB", "TP 1 x EP 8"]
    assert unprinted("74.1 GiB on TP 4 x EP 8, 32 processes", printed) == []
    assert unmatched(("trainer: 32 ...", "peak is ..."), printed.splitlines()) == "peak is ..."  # out of order
