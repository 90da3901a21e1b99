"""The documents a clone has: README.md and docs/ link files that are in the repository, and cite
nothing from beside it (the development notes in shared/ are not part of a clone)."""

import re
from pathlib import Path

import pytest

from bapo_megatron import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def outside_the_repository(doc: Path) -> list[str]:
    """A document's relative links that name no file of the repository, and its citations of shared/."""
    text = doc.read_text()
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if not t.startswith(("http://", "https://", "mailto:"))]
    missing = [t for t in links if not (doc.parent / t).exists()]
    return missing + re.findall(r"(?<![\w/])shared/[\w./-]+", text)


def test_the_bapo_specification_is_in_the_repository_and_linked():
    assert "](docs/BAPO_SPEC.md)" in (ROOT / "README.md").read_text()
    spec = (ROOT / "docs" / "BAPO_SPEC.md").read_text()
    assert spec.startswith("# BAPO: the exact specification this project implements")
    for path in re.findall(r"`(bapo_megatron/[\w/]+\.py)`", spec):  # the modules it names exist
        assert (ROOT / path).is_file(), path


def test_documents_cite_only_files_in_the_repository():
    assert {doc.name for doc in DOCS} >= {"README.md", "BAPO_SPEC.md"}
    found = {str(doc.relative_to(ROOT)): outside_the_repository(doc) for doc in DOCS}
    assert not any(found.values()), found


def test_the_check_finds_a_citation_from_beside_the_repository(tmp_path):
    doc = tmp_path / "README.md"
    (tmp_path / "here.md").write_text("")
    doc.write_text("See [here](here.md), [there](docs/gone.md) and `shared/BAPO_SPEC.md`.\n")
    assert outside_the_repository(doc) == ["docs/gone.md", "shared/BAPO_SPEC.md"]


def test_the_help_says_where_paths_resolve_and_what_world_the_dry_run_plans(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "resolve against the working directory: run the examples from the repository root" in text
    assert "the slurm/ script that runs the config" in text and "TP x PP x CP" in text  # as planned_world picks
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "Every command in this README runs from the repository root" in readme
