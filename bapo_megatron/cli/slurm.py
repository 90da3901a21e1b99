"""The Slurm script that runs a config, found for the dry run: its world and where it puts the engines.

    search = find_slurm_plan(Path("examples/qwen2.5-7b/recipe.yaml"))
    search.plan          # SlurmPlan of slurm/bapo_7b.sh (8 trainer processes, 1 rollout node), or None
    search.none_found()  # what was searched, when no script runs the config

The scripts are looked for beside the config, not beside the installed package (a non-editable
install has no slurm/): in the slurm/ folder of the nearest directory above the config that has
one (the checkout the config belongs to), then in $BAPO_HOME/slurm, the checkout the scripts
themselves source common.sh from.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
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
            return SlurmSearch(config, folders, max(plans, key=lambda plan: plan.default))
    return SlurmSearch(config, folders, None)
