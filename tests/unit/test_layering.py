"""The import direction of the package's layers and top-level modules, function-level imports included:

    errors, fsutil -> algo -> config -> common -> trainer, rollout -> weights
        -> logger, tasks, evaluate, serve, preflight -> cli, driver -> sources -> job -> train

A module may import its own layer and those before it, never one after, and never a sibling of its
rank: the trainer knows nothing of the engines, the engines nothing of the trainer, only the weight
tools and the top floor join the two, and the top-floor modules import each other in one direction
(cli, train, driver once imported each other in a circle that a single rank for them all could not
see)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "bapo_megatron"
RANK = {
    "errors": 0,
    "fsutil": 0,
    "algo": 1,
    "config": 2,
    "common": 3,
    "trainer": 4,
    "rollout": 4,
    "weights": 5,
    "logger": 6,
    "tasks": 6,
    "evaluate": 6,
    "serve": 6,
    "preflight": 6,
    "cli": 7,
    "driver": 7,
    "sources": 8,
    "job": 9,
    "train": 10,
    "__init__": 11,
}


def layer(module: str) -> str:
    """'bapo_megatron.rollout.batch' -> 'rollout'; 'bapo_megatron.train' -> 'train'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def rank(name: str) -> int:
    return RANK[name]


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
            if rank(target) > rank(own) or (target != own and rank(target) == rank(own)):
                bad.append(f"{file.relative_to(PACKAGE)}:{line} ({own}) imports {module} ({target})")
    return bad


def test_layers_import_only_downwards():
    assert not violations(), "\n".join(violations())


def test_every_module_has_a_rank():
    """A new top-level module must be placed: an unranked one would pass unchecked."""
    names = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")}
    names -= {"__pycache__"}
    assert names <= set(RANK), sorted(names - set(RANK))


def test_the_check_sees_function_level_imports_and_would_catch_the_old_circles(tmp_path):
    """It would catch the old circles: trainer -> rollout.batch, rollout -> weights inside a function,
    driver -> cli and cli -> train -> driver at the top."""
    file = tmp_path / "x.py"
    file.write_text("def f():\n    from bapo_megatron.weights.hf_io import HFCheckpoint\n")
    assert imports(file) == [(2, "bapo_megatron.weights.hf_io")]
    assert rank(layer("bapo_megatron.weights.hf_io")) > rank("rollout")
    assert rank(layer("bapo_megatron.rollout.batch")) == rank("trainer")  # a sibling: refused by violations()
    assert rank(layer("bapo_megatron.cli")) == rank("driver")  # driver -> cli (rollout_mem_fraction): a sibling
    assert rank(layer("bapo_megatron.train")) > rank("cli")  # cli -> train (validate, model_spec) refused
