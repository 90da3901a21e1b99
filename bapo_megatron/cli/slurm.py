"""The Slurm script that runs a config, found for the dry run: its world and where it puts the engines.

    search = find_slurm_plan(Path("examples/qwen2.5-7b/recipe.yaml"))
    search.plan          # SlurmPlan of slurm/bapo_7b.sh (8 trainer processes, 1 rollout node), or None
    search.none_found()  # what was searched, when no script runs the config

The scripts are looked for beside the config, not beside the installed package (a non-editable
install has no slurm/): in the slurm/ folder of the nearest directory above the config that has
one (the checkout the config belongs to), then in $BAPO_HOME/slurm, the checkout the scripts
themselves source common.sh from. A preset meant for another node count than its script's default
says so in the command its comments give (`TRAIN_NODES=1 CONFIG=<it> ... sbatch --nodes=2 slurm/X.sh`,
as examples/qwen2.5-32b/lora.yaml does): that command's nodes are the plan's (stated_plan).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

SLURM_CONFIG = re.compile(r"^CONFIG=\$\{CONFIG:-(\S+?)\}", re.M)
SLURM_JOB = re.compile(r"^bapo_gpu_job\s+(\d+)\s+(\d+)\b", re.M)
SLURM_GPUS = re.compile(r"^#SBATCH\s+--gpus-per-node=(\d+)", re.M)
SLURM_NODES = re.compile(r"^#SBATCH\s+--nodes=(\d+)", re.M)


@dataclass(frozen=True)
class SlurmPlan:
    """How a slurm/*.sh script runs a config: its `bapo_gpu_job TRAIN_NODES ENGINES_PER_NODE ...`
    line and its #SBATCH header (the nodes beyond the trainer's hold the engines)."""

    script: Path
    """The script, as found."""
    default: bool
    """The config is the script's default CONFIG (else one beside it, run with CONFIG=...)."""
    train_nodes: int
    engines_per_node: int
    nodes: int
    gpus_per_node: int
    stated: str | None = None
    """The command in the config's comments whose nodes these are (stated_plan), None: the script's own."""

    @property
    def world_size(self) -> int:
        return self.train_nodes * self.gpus_per_node

    @property
    def rollout_nodes(self) -> int:
        return self.nodes - self.train_nodes

    @property
    def name(self) -> str:
        """The script's path as the dry run says it: from the working directory when it lies below it."""
        return _shown(self.script)


@dataclass(frozen=True)
class SlurmSearch:
    """Where the dry run looked for the script that runs a config, and what it found."""

    config: Path
    folders: tuple[Path, ...]
    """The slurm/ folders searched, nearest first."""
    plan: SlurmPlan | None

    def none_found(self) -> str:
        """Why no script was found, naming what was searched."""
        if not self.folders:
            return (
                f"no Slurm script found: no slurm/ folder above {_shown(self.config)} and no $BAPO_HOME "
                "(the checkout whose slurm/ scripts run it)"
            )
        where = " or ".join(f"{_shown(folder)}/" for folder in self.folders)
        return f"no Slurm script in {where} runs {_shown(self.config)} (as its CONFIG, or one beside it)"


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def slurm_folders(config: Path) -> tuple[Path, ...]:
    """The slurm/ folders whose scripts may run `config`: the nearest above it, then $BAPO_HOME's."""
    folders = [next((d / "slurm" for d in config.parents if (d / "slurm").is_dir()), None)]
    if os.environ.get("BAPO_HOME"):
        folders.append((Path(os.environ["BAPO_HOME"]) / "slurm").resolve())
    found: list[Path] = []
    for folder in folders:
        if folder is not None and folder.is_dir() and folder not in found:
            found.append(folder)
    return tuple(found)


def read_plans(folder: Path, config: Path) -> list[SlurmPlan]:
    """The scripts of one slurm/ folder that run `config`: those whose default CONFIG (a path from
    the folder's checkout, where common.sh runs) it is, or lies beside (a preset's variants,
    recipe.yaml and long.yaml, run by their preset's script with CONFIG=...)."""
    found = []
    for script in sorted(folder.glob("*.sh")):
        text = script.read_text()
        default, job = SLURM_CONFIG.search(text), SLURM_JOB.search(text)
        gpus, nodes = SLURM_GPUS.search(text), SLURM_NODES.search(text)
        if not (default and job and gpus and nodes):
            continue
        preset = (folder.parent / default.group(1)).resolve()
        if preset == config or preset.parent == config.parent:
            numbers = (int(job.group(1)), int(job.group(2)), int(nodes.group(1)), int(gpus.group(1)))
            found.append(SlurmPlan(script, preset == config, *numbers))
    return found


def find_slurm_plan(config: Path) -> SlurmSearch:
    """The script that runs `config`, from the first folder of slurm_folders that has one: the one
    whose default CONFIG it is, else one whose default lies beside it."""
    config = config.resolve()
    folders = slurm_folders(config)
    for folder in folders:
        plans = read_plans(folder, config)
        if plans:
            return SlurmSearch(config, folders, stated_plan(config, max(plans, key=lambda plan: plan.default)))
    return SlurmSearch(config, folders, None)


NODE_VARIABLES = {"TRAIN_NODES": "train_nodes", "ENGINES_PER_NODE": "engines_per_node"}
"""The environment variables of a script's bapo_gpu_job line (slurm/common.sh: the environment wins)."""


def stated_plan(config: Path, plan: SlurmPlan) -> SlurmPlan:
    """`plan` with the nodes the config's own comments run it on: the first commented command that runs
    plan's script with CONFIG=config (`TRAIN_NODES=1 CONFIG=... sbatch --nodes=2 slurm/bapo_32b.sh`,
    continued over lines with a backslash) gives its TRAIN_NODES, ENGINES_PER_NODE and --nodes (each
    where given); `plan` as it is when there is none or it states the script's own nodes."""
    text = config.read_text() if config.is_file() else ""  # (a config yet to be written states nothing)
    for words in _commented_commands(text):
        if "sbatch" not in words:
            continue
        at = words.index("sbatch")
        env = dict(w.split("=", 1) for w in words[:at] if re.fullmatch(r"[A-Z_]+=\S*", w))
        options = words[at + 1 :]
        script = next((w for w in options if w.endswith(".sh")), None)
        where = plan.script.parent.parent  # the checkout whose paths CONFIG names (common.sh runs there)
        if script is None or Path(script).name != plan.script.name or "CONFIG" not in env:
            continue
        if (where / env["CONFIG"]).resolve() != config:
            continue
        numbers = {field: int(env[name]) for name, field in NODE_VARIABLES.items() if env.get(name, "").isdigit()}
        nodes = next((w.split("=", 1)[1] for w in options if w.startswith("--nodes=")), None)
        if nodes is not None and nodes.isdigit():
            numbers["nodes"] = int(nodes)
        if all(getattr(plan, field) == n for field, n in numbers.items()):
            return plan  # the script's own nodes: said as before
        stated = replace(plan, **numbers, stated=" ".join(words))
        if stated.nodes >= stated.train_nodes >= 1:
            return stated
    return plan


def _commented_commands(text: str) -> list[list[str]]:
    """The words of each command in the comment lines of a YAML file, a line ending in a backslash
    continued on the next comment line; lines that are no shell words left out."""
    commands, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            pending = ""
            continue
        body = pending + stripped.lstrip("#").strip()
        if body.endswith("\\"):
            pending = body[:-1] + " "
            continue
        pending = ""
        try:
            commands.append(shlex.split(body))
        except ValueError:  # prose with an unmatched quote: not a command
            continue
    return commands
