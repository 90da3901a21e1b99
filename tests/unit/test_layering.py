"""The import direction of the package's layers, function-level imports included:

    errors, fsutil -> algo -> config -> common -> trainer, rollout -> weights -> driver modules

A module may import its own layer and those before it, never one after: the trainer knows
nothing of the engines, the engines nothing of the trainer, and only the weight tools and the
driver modules (train, driver, cli, logger) join the two."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bapo_megatron"
RANK = {"errors": 0, "fsutil": 0, "algo": 1, "config": 2, "common": 3, "trainer": 4, "rollout": 4, "weights": 5}
TOP = 6  # train, driver, cli, logger, __init__


def layer(module: str) -> str:
    """'bapo_megatron.rollout.batch' -> 'rollout'; 'bapo_megatron.train' -> 'train'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def rank(name: str) -> int:
    return RANK.get(name, TOP)


def imports(file: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of this package in `file`, at any depth."""
    out = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bapo_megatron"):
            if node.module == "bapo_megatron":  # from bapo_megatron import cli
                out += [(node.lineno, f"bapo_megatron.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("bapo_megatron.")]
    return out


def violations() -> list[str]:
    bad = []
    for file in sorted(PACKAGE.rglob("*.py")):
        own = file.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for line, module in imports(file):
            target = layer(module)
            if rank(target) > rank(own) or (rank(own) == 4 and target != own and rank(target) == 4):
                bad.append(f"{file.relative_to(PACKAGE)}:{line} ({own}) imports {module} ({target})")
    return bad


def test_layers_import_only_downwards():
    assert not violations(), "\n".join(violations())


def test_the_check_sees_function_level_imports(tmp_path):
    """It would catch the old circle: trainer -> rollout.batch, rollout -> weights inside a function."""
    file = tmp_path / "x.py"
    file.write_text("def f():\n    from bapo_megatron.weights.hf_io import HFCheckpoint\n")
    assert imports(file) == [(2, "bapo_megatron.weights.hf_io")]
    assert rank(layer("bapo_megatron.weights.hf_io")) > rank("rollout")
    assert rank(layer("bapo_megatron.rollout.batch")) == rank("trainer")  # a sibling: refused by violations()
