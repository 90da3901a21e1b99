"""The import direction of the package's layers and top-level modules, function-level imports included:

    errors, fsutil -> algo -> config -> models -> common -> trainer, engines, data, rewards -> rollout, weights
        -> logger, tasks, evaluate, serve, preflight -> plan -> cli, driver -> sources, runinfo -> job -> train

A module may import its own layer and those before it, never one after, and never a sibling of its
rank: the model families (models/, with the ModelSpec they read) sit under everything that asks
them; the trainer knows nothing of the engines, the engines nothing of the trainer, data or
rewards (the embedded engine is the engines' own), rewards nothing of how records are read;
generation (rollout) joins engines, data and rewards, the weight tools join the trainer and the
engines, and only the top floor joins the two, and the top-floor modules import each other in one direction
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
    "models": 3,
    "common": 4,
    "trainer": 5,
    "engines": 5,
    "data": 5,
    "rewards": 5,
    "rollout": 6,
    "weights": 6,
    "run_checks": 6,
    "logger": 7,
    "tasks": 7,
    "evaluate": 7,
    "serve": 7,
    "preflight": 7,
    "handoff": 7,
    "plan": 8,
    "cli": 9,
    "driver": 9,
    "sources": 10,
    "runinfo": 10,
    "job": 11,
    "train": 12,
    "__init__": 13,
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


def violations(package: Path = PACKAGE) -> list[str]:
    bad = []
    for file in sorted(package.rglob("*.py")):
        own = file.relative_to(package).parts[0].removesuffix(".py")
        for line, module in imports(file):
            target = layer(module)
            if rank(target) > rank(own) or (target != own and rank(target) == rank(own)):
                bad.append(f"{file.relative_to(package)}:{line} ({own}) imports {module} ({target})")
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
    assert rank(layer("bapo_megatron.weights.hf_io")) > rank("engines")
    assert rank(layer("bapo_megatron.weights.sync")) == rank("rollout")  # a sibling: refused by violations()
    assert rank(layer("bapo_megatron.rollout.buffer")) > rank("trainer")  # trainer -> rollout refused
    assert rank(layer("bapo_megatron.engines.client")) == rank("trainer")  # a sibling: refused by violations()
    assert rank(layer("bapo_megatron.cli")) == rank("driver")  # driver -> cli (rollout_mem_fraction): a sibling
    assert rank(layer("bapo_megatron.train")) > rank("cli")  # cli -> train (validate, model_spec) refused


def test_the_check_catches_arrows_between_the_rollout_packages(tmp_path):
    """The packages split out of rollout/ stay apart: an engine that imports the buffer (back up), a
    reward that reads records (a sibling), data that scores (a sibling) are each refused; generation
    importing all three is not."""
    cases = {
        "engines/pool.py": "from bapo_megatron.rollout.buffer import RolloutBuffer\n",
        "rewards/functions.py": "from bapo_megatron.data.records import open_records\n",
        "data/prompts.py": "def f():\n    from bapo_megatron.rewards.workers import RewardWorkers\n",
        "rollout/core.py": (
            "from bapo_megatron.engines.pool import EnginePool\nfrom bapo_megatron.data.prompts import PromptSource\n"
            "from bapo_megatron.rewards.workers import RewardWorkers\n"
        ),
    }
    for path, text in cases.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    found = violations(tmp_path)
    assert [v.split(":")[0] for v in found] == ["data/prompts.py", "engines/pool.py", "rewards/functions.py"], found
