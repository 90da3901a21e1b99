"""Every config field is read by something: a field that nothing reads is a setting that silently
does nothing. Each field of every section must be read as an attribute (`cfg.rollout.oversample`,
`self.cfg.tis_cap`) or by name (`getattr(x, "field")`) somewhere in the package outside the
modules that only define, document or print the config."""

import ast
import dataclasses
from pathlib import Path

from bapo_megatron.config import JobConfig

PACKAGE = Path(__file__).resolve().parents[2] / "bapo_megatron"
DEFINING = ("config", "cli")  # the definitions and loader, --help-config and --dry-run's printout


def sections(cls: type, path: str = "job") -> dict[str, type]:
    """Every section class under `cls` by its dotted path (nested dataclasses found on a default instance)."""
    out = {path: cls}
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out.update(sections(type(value), f.name if path == "job" else f"{path}.{f.name}"))
    return out


def names_read(package: Path = PACKAGE) -> set[str]:
    found: set[str] = set()
    for file in package.rglob("*.py"):
        if file.relative_to(package).parts[0] in DEFINING:
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                found.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    found.add(name.value)
    return found


def test_every_config_field_is_read_somewhere():
    read = names_read()
    unread = [
        f"{path}.{f.name}" if path != "job" else f.name
        for path, cls in sections(JobConfig).items()
        for f in dataclasses.fields(cls)
        if f.name not in read
    ]
    assert not unread, f"config fields read by nothing: {unread}"


def test_the_check_finds_an_unread_field():
    """The check can fail: a field named like nothing in the package is reported."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Probe:
        surely_nobody_reads_this_field: int = 0

    assert "surely_nobody_reads_this_field" not in names_read()
    assert {"oversample", "max_staleness", "mask_stale_prefix"} <= names_read()


def test_only_the_defining_modules_are_left_out(tmp_path):
    """Reads in config/ and cli/ (any depth) do not count; a read in any other module does, a
    module named config.py elsewhere included."""
    files = {
        "config/job.py": "x.only_in_config_job",
        "config/nested/deep.py": "x.only_in_config_deep",
        "cli/dry_run.py": "x.only_in_cli",
        "rollout/config.py": "x.read_in_rollout_config",
        "driver.py": "x.read_in_driver",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text + "\n")
    assert names_read(tmp_path) == {"read_in_rollout_config", "read_in_driver"}


def undescribed(cls: type = JobConfig) -> list[str]:
    """The fields --help-config lists without a description (no docstring under the field)."""
    from bapo_megatron.cli import config_fields

    return [name for name, _type, _default, doc in config_fields(cls) if not doc]


def test_every_config_field_is_described():
    """--help-config is generated from the field docstrings: a field without one is a setting the
    user can find but not understand."""
    assert not undescribed(), f"config fields without a docstring: {undescribed()}"


def test_the_description_check_finds_an_undescribed_field():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Probe:
        described: int = 0
        """Something."""
        bare: int = 0

    assert undescribed(Probe) == ["bare"]
