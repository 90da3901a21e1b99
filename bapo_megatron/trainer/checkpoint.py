"""Megatron dist checkpoints (torch_dist): written to a temporary directory, renamed, then `latest`.

A kill during a save never leaves a broken checkpoint: the step directory appears under its
final name only once complete (its files checksummed, trainer/integrity.py, and fsync'd with
the rename), and the pointer file is replaced atomically afterwards. A kill between the two
costs nothing: on start the newest complete step directory wins over a stale `latest`, which
is repaired. Directories are named by the driver's step (not the optimizer's, which skipped
updates leave unchanged), pruning never removes the newest, what `latest` names or what was
just written, and a run that would start afresh over existing checkpoints is refused.
Received checkpoints are read without running code from them (trainer/safe_load.py).
Checkpoints store sharded tensors by global name, so they load at any TP/PP layout. Each step
directory also carries its model's Hugging Face config (hf_config.json) and the tokenizer files
of model.hf_path, so that it converts to a HF model and is evaluated with nothing else at hand, and
the tensors its family keeps untrained (hf_kept.safetensors: a vision tower, MTP layers), which the
export writes back untouched: streamed from their source at a run's first save, hard-linked from the
previous step's copy at the next ones (CarriedFile).
A run with a KL loss stores its reference model too (trainer/reference.py: the run's starting
weights, which a resumed run measures its KL to again). A LoRA run whose base has a source (model.hf_path
or model.mcore_path) saves the adapters, their optimizer state and the rest without the frozen base
(CheckpointManager.without_base: 65 GB a save at 32B otherwise), its lora_base.json naming the base, which
every start loads from that source and checks (trainer/base_identity.py); a checkpoint with the base
beside the adapters (a seed start's, or one written before) loads as well.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from bapo_megatron.common.hf_io import KEPT_FILE, TOKENIZER_FILES, HFCheckpoint, KeptSource, open_kept_file
from bapo_megatron.config import CheckpointConfig
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.fsutil import remove, write_text_atomic
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer import safe_load
from bapo_megatron.trainer.dist_ckpt import (
    ExtraFile,
    adapters_only,
    barrier,
    holds_base,
    is_rank0,
    load_module_state,
    load_sharded,
    model_sharded_state_dict,
    rng_states,
    save_sharded,
    set_rng_states,
    unwrap,
    verify_on_all_ranks,
)
from bapo_megatron.trainer.integrity import (
    CHECKSUMS,
    CorruptCheckpointError,
    read_checksums,
    verify_integrity,
)

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8})$")
STALE_TMP = re.compile(r"^\.step_\d{8}\..+\.tmp$")  # a killed save's temporary (fsutil.temporary_sibling)
HF_CONFIG = "hf_config.json"
"""The model's HF config.json beside a dist checkpoint's weights (trainer's and converter's alike)."""
RUN_RECORD = "run.json"
"""Which run wrote a step directory: its name and what makes it that run (job.py compares them on resume)."""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def weights_dir(path: str | Path) -> Path:
    """The dist checkpoint whose weights a path names (model.mcore_path, the converters, reshard): a
    step or converted directory as it is; a run's checkpoint.dir, the step a resume would load (the
    newest complete one, which `latest` names unless a save was cut short), read only; a run's
    directory, its ckpt/ as such. A path that is none of these comes back as it is, for the reader
    to refuse."""
    root = Path(path)
    if (root / "metadata.json").is_file():
        return root
    if not (root / LATEST).exists() and (root / "config.yaml").is_file() and (root / "ckpt").is_dir():
        root = root / "ckpt"  # a run directory (checkpoint.dir's default)
    manager = CheckpointManager(CheckpointConfig(dir=str(root)))
    steps = manager.complete_steps()
    if steps:
        return steps[-1][1]
    named = manager._pointer()  # a pointer that is a link or not a step name: refused by name
    if named is not None:
        raise BadInputError(f"checkpoint pointer {root / LATEST} names {named}, which is not a complete checkpoint")
    return root


def model_files(spec: ModelSpec, hf_path: str | None, mcore_path: str | None = None) -> dict[str, ExtraFile]:
    """What a checkpoint carries of its model beyond the weights: its HF config as hf_config.json
    (model.hf_path's config.json as it is, or the built-in model's), model.hf_path's tokenizer files,
    by their own names, and the tensors its family keeps untrained (KEPT_FILE, written when the
    checkpoint is: a vision tower or a DeepSeek-V3 MTP layer is too large to hold) from model.hf_path's
    weights, else from those mcore_path's checkpoint carries. The kept tensors' files are opened now and
    stay open (memory-mapped), so a source moved or deleted during the run still saves."""
    if hf_path is None:
        files: dict[str, ExtraFile] = {HF_CONFIG: json.dumps(spec.to_hf_config(), indent=2)}
    else:
        root = Path(hf_path)
        files = {HF_CONFIG: (root / "config.json").read_bytes()}
        files.update({name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()})
    kept = _kept_source(spec, hf_path, mcore_path, json.loads(files[HF_CONFIG]))
    if kept:
        files[KEPT_FILE] = CarriedFile(kept)
    return files


class CarriedFile:
    """The kept tensors' file (KEPT_FILE) a run's checkpoints carry (a dist_ckpt.StreamedFile): streamed
    from its source, held open for the run, at the run's first save; at the next ones hard-linked from
    the copy the previous save published, while its checkpoint still records the checksum written
    (copied where no link can be made): gigabytes written once a run, not once a save. Its size is
    budgeted in full at every save (a link may fall back to a copy)."""

    def __init__(self, source: KeptSource) -> None:
        self.source = source
        self.nbytes = sum(e.nbytes + len(e.name) + 128 for e in source.entries())  # + its header entry
        self.last: Path | None = None
        """The copy the last save published (CheckpointManager.save)."""
        self.checksum: dict[str, int] | None = None
        """What its checkpoint recorded for it (integrity.file_checksum's)."""
        self.reuse: Path | None = None
        """The copy the next call links instead of streaming (find_copy's, set before each save)."""

    def __call__(self, path: Path) -> dict[str, int] | None:
        if self.reuse is None:
            self.source.write(path)
            return None
        try:
            os.link(self.reuse, path)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(self.reuse, path)
        return self.checksum

    def find_copy(self) -> Path | None:
        """The last save's copy while its checkpoint is there and still lists it with the checksum it
        recorded (and its size is that); None before this process saved, or once it was pruned or replaced."""
        if self.last is None or not (self.last.parent / CHECKSUMS).is_file():
            return None
        try:
            recorded = read_checksums(self.last.parent / CHECKSUMS).get(KEPT_FILE)
        except CorruptCheckpointError:
            return None
        if recorded is None or recorded != self.checksum or self.last.is_symlink() or not self.last.is_file():
            return None
        return self.last if self.last.stat().st_size == recorded["size"] else None


def _kept_source(spec: ModelSpec, hf_path: str | None, mcore_path: str | None, config: dict) -> KeptSource | None:
    """The kept tensors of the run's starting weights: model.hf_path's safetensors, else those a
    model.mcore_path checkpoint carries, each one the family keeps for the run's `config` (None: no
    source has any)."""
    if hf_path is not None and any(Path(hf_path).glob("*.safetensors")):
        return HFCheckpoint(hf_path).kept
    if mcore_path is None or not (weights_dir(mcore_path) / KEPT_FILE).is_file():
        return None
    return open_kept_file(weights_dir(mcore_path) / KEPT_FILE, spec, config)


def run_record(directory: str | Path) -> dict | None:
    """The run.json a step directory carries (None: one saved before checkpoints recorded their run);
    BadInputError for one that is not a small JSON object."""
    path = Path(directory) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text()) if path.stat().st_size < 1 << 20 else None
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise BadInputError(f"checkpoint {directory}: {RUN_RECORD} is not the JSON object a run writes")
    return record


def refuse_step_dir(root: str | Path) -> None:
    """ConfigError when checkpoint.dir is itself one dist checkpoint (it holds metadata.json), as verl's
    trainer.resume_from_path names one step's directory: a run there finds no step directories in it,
    starts over and saves its own steps inside it. Before anything loads (preflight.validate and
    check_start: the dry run refuses what the run refuses)."""
    root = Path(root)
    if (root / "metadata.json").is_file():
        raise ConfigError(
            "checkpoint.dir",
            str(root),
            f"is one step's checkpoint directory (it holds metadata.json), not a directory of step directories: "
            f"point checkpoint.dir at its parent {root.parent} to resume that run, or set model.mcore_path={root} "
            "to start a new run from its weights",
        )


def step_of(directory: str | Path) -> int:
    """The driver step a step directory is named by (step_00000012: 12)."""
    return int(STEP_DIR.match(Path(directory).name).group(1))


class CheckpointManager:
    """Save and resume a trainer: model, optimizer, LR schedule, RNG, step and registered extras.

    Layout: DIR/step_00000012/ (a dist checkpoint) and DIR/latest (the name of the newest
    complete one). Extras are objects with state_dict()/load_state_dict() that the driver
    registers (rollout buffer, data cursor); their state is saved by rank 0.
    """

    def __init__(self, cfg: CheckpointConfig, config_yaml: str = "", record: dict | None = None) -> None:
        if cfg.dir is None:
            raise ValueError("CheckpointManager needs checkpoint.dir")
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self.config_yaml = config_yaml
        self.record = record  # written to each step directory as run.json
        self.extras: dict[str, Stateful] = {}
        self.without_base = False
        """Whether the checkpoints leave the model's frozen base out (a LoRA run whose base job.py
        loads from its source at every start, lora_base.json naming it): the adapters, their optimizer
        state and the rest alone. Loading follows what a checkpoint holds, either way."""

    def register(self, name: str, obj: Stateful) -> None:
        self.extras[name] = obj

    def _sharded(self, trainer, is_loading: bool, with_rng: bool, with_base: bool = True) -> dict:
        model_sd = model_sharded_state_dict(trainer.model)
        if not with_base:  # (the optimizer holds the adapters alone: its state maps onto these)
            model_sd = adapters_only(model_sd)
        sharded = {
            "model": model_sd,
            "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        }
        if trainer.reference is not None:
            sharded["reference"] = trainer.reference.sharded_state_dict(is_loading=is_loading)
        if with_rng:
            from megatron.core.dist_checkpointing.mapping import ShardedObject

            rank, world = dist.get_rank(), dist.get_world_size()
            sharded["rng"] = ShardedObject("rng_state", rng_states(), (world,), (rank,), replica_id=0)
        return sharded

    def save(self, trainer, iteration: int | None = None) -> Path:
        """Write step_<iteration> (default: the optimizer step) through a temporary directory, then
        point `latest` at it, then prune. A complete directory of that step already there (a save
        repeated after a kill) counts as done."""
        iteration = trainer.step if iteration is None else iteration
        directory = self.root / f"step_{iteration:08d}"
        if directory.exists():
            if self._iteration_of(directory) != iteration:
                raise FileExistsError(f"checkpoint {directory} exists and is not a complete step {iteration}")
        else:
            sharded = self._sharded(trainer, is_loading=False, with_rng=True, with_base=not self.without_base)
            sharded["common"] = {
                "step": trainer.step,
                "iteration": iteration,
                "world_size": dist.get_world_size(),
                "scheduler": trainer.scheduler.state_dict(),
                "extras": {name: obj.state_dict() for name, obj in self.extras.items()},
                "config": self.config_yaml,
                "reference": trainer.reference is not None,
            }
            files = dict(trainer.model_files) if is_rank0() else None  # read when the run started
            if files is not None and self.record is not None:
                files[RUN_RECORD] = json.dumps(self.record, indent=1, sort_keys=True) + "\n"
            carried = (files or {}).get(KEPT_FILE)
            if isinstance(carried, CarriedFile):
                carried.reuse = carried.find_copy()
            save_sharded(sharded, directory, extra_files=files)
            if isinstance(carried, CarriedFile):  # for the next save to link
                carried.last, carried.checksum = directory / KEPT_FILE, read_checksums(directory / CHECKSUMS)[KEPT_FILE]
        if is_rank0():
            write_text_atomic(self.root / LATEST, directory.name + "\n")
            self._prune(protect={directory.name})
        barrier()
        return directory

    @staticmethod
    def _iteration_of(directory: Path) -> int | None:
        from megatron.core import dist_checkpointing

        try:
            verify_integrity(directory, check_contents=False)
            common = dist_checkpointing.load_common_state_dict(str(directory))["common"]
        except Exception:
            return None
        return common.get("iteration", common.get("step"))

    def complete_steps(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete step directory, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and path.is_dir() and not path.is_symlink() and (path / "metadata.json").is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def set_aside_incomplete(self) -> list[Path]:
        """Step directories without metadata.json (a save another tool interrupted; ours write to a
        temporary and rename) renamed to step_NNNNNNNN.incomplete[.K] and reported: left in place, a
        resumed run would reach that step, find its name taken and stop there on every resume."""
        moved = []
        if not self.root.is_dir():
            return moved
        for path in sorted(self.root.iterdir()):
            if STEP_DIR.match(path.name) and path.is_dir() and not path.is_symlink():
                if (path / "metadata.json").is_file():
                    continue
                target, k = path.with_name(path.name + ".incomplete"), 1
                while target.exists():
                    target, k = path.with_name(f"{path.name}.incomplete.{k}"), k + 1
                path.rename(target)
                moved.append(target)
                print(
                    f"checkpoint: {path} has no metadata.json (an interrupted save): set aside as {target.name}; "
                    "the run resumes from the newest complete step",
                    file=sys.stderr,
                    flush=True,
                )
        return moved

    def _pointer(self) -> str | None:
        """The step name `latest` holds (None: no pointer); ValueError for one that is not a plain
        file naming a step (its content is never echoed)."""
        pointer = self.root / LATEST
        if pointer.is_symlink():
            raise BadInputError(f"checkpoint pointer {pointer} is a symbolic link; expected a file naming a step")
        if not pointer.exists():
            return None
        if not pointer.is_file() or pointer.stat().st_size > 64:
            raise BadInputError(f"checkpoint pointer {pointer} is not a small file naming a step (step_NNNNNNNN)")
        name = pointer.read_text(errors="replace").strip()
        if not STEP_DIR.match(name):
            raise BadInputError(f"checkpoint pointer {pointer} does not name a step directory (step_NNNNNNNN)")
        return name

    def _prune(self, protect: set[str]) -> None:
        """Keep the newest keep_last steps, what `latest` names and `protect`; drop killed saves' temporaries."""
        steps = self.complete_steps()
        keep = {p.name for _, p in steps[-self.cfg.keep_last :]} | protect
        try:
            named = self._pointer()
        except ValueError:
            named = None
        keep |= {named} if named else set()
        for _, path in steps:
            if path.name not in keep:
                remove(path)
        for path in self.root.iterdir():
            if STALE_TMP.match(path.name) and not path.is_symlink():
                remove(path)

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the newest complete step directory (None: there is none).
        `latest` names it, except after a kill between a step's rename and the pointer's update:
        then the newer directory wins and the pointer is repaired. ValueError when `latest` names
        a step but no complete checkpoint exists."""
        steps = self.complete_steps()
        try:
            named = self._pointer()
        except ValueError as err:
            if not steps:
                raise
            named, problem = None, str(err)
        else:
            problem = f"names {named}" if named else "is missing"
        if not steps:
            if named is not None:
                raise ValueError(
                    f"checkpoint pointer {self.root / LATEST} names {named!r}, which is not a complete "
                    "checkpoint, and there is no other"
                )
            return None
        newest = steps[-1][1]
        if named != newest.name:
            warnings.warn(
                f"checkpoint pointer {self.root / LATEST} {problem}; resuming from the newest complete "
                f"checkpoint {newest.name} and repairing the pointer",
                stacklevel=2,
            )
            if is_rank0():
                write_text_atomic(self.root / LATEST, newest.name + "\n")
        return newest

    def check_start(self, resume: bool, rank: int = 0) -> None:
        """ConfigError when a run that would not resume starts in a directory holding checkpoints
        (its saves would mix with theirs, and pruning would choose among both). A resuming run's
        rank 0 sets step directories without metadata.json aside (set_aside_incomplete)."""
        for path in (self.root, *self.root.parents):
            if path.exists() and not path.is_dir():
                where = "is" if path == self.root else f"lies under {path}, which is"
                raise ConfigError("checkpoint.dir", str(self.root), f"{where} a file, not a directory")
        refuse_step_dir(self.root)
        pointer = self.root / LATEST
        if pointer.is_dir() and not pointer.is_symlink():
            raise BadInputError(
                f"checkpoint pointer {pointer} is a directory; expected a file naming a step (step_NNNNNNNN): "
                "move it away (the newest complete step is then resumed)"
            )
        if resume and rank == 0:
            self.set_aside_incomplete()
        steps = self.complete_steps()
        if steps and not resume:
            raise ConfigError(
                "checkpoint.resume",
                False,
                f"{self.root} holds checkpoints (newest {steps[-1][1].name}): resume from them "
                "(checkpoint.resume=true), or point checkpoint.dir at a new directory",
            )

    def load(self, trainer, directory: str | Path | None = None) -> int | None:
        """Restore everything from `directory` (default: latest); the driver step it resumes at
        (the optimizer step for checkpoints written before driver steps were recorded), or None."""
        from megatron.core import dist_checkpointing

        directory = Path(directory) if directory is not None else self.latest()
        if directory is None:
            return None
        verify_on_all_ranks(directory)  # files there, whole and as written, before the slow part starts
        safe_load.install_safe_loaders()
        common = dist_checkpointing.load_common_state_dict(str(directory))["common"]
        if trainer.reference is not None and not common.get("reference"):
            raise ConfigError(
                "algo.kl_coef",
                trainer.cfg.algo.kl_coef,
                f"checkpoint {directory} was saved without a KL loss and holds no reference model (the run's "
                "starting weights): resume with algo.kl_coef=0, or start a new run from it (model.mcore_path)",
            )
        same_world = common["world_size"] == dist.get_world_size()
        with_base = holds_base(model_sharded_state_dict(trainer.model), directory)  # (adapters alone: base as loaded)
        if not with_base and not trainer.cfg.model.lora.enabled:
            raise ConfigError(
                "model.lora.rank", 0, f"checkpoint {directory} holds LoRA adapters alone: resume it with its model.lora"
            )
        loaded = load_sharded(self._sharded(trainer, True, with_rng=same_world, with_base=with_base), directory)
        for i, chunk in enumerate(trainer.model):
            load_module_state(unwrap(chunk), loaded["model"][f"chunk{i}"], directory, adapters_only=not with_base)
        if trainer.reference is not None:
            trainer.reference.load(loaded["reference"], directory)
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        trainer.scheduler.load_state_dict(common["scheduler"])
        if same_world:
            set_rng_states(loaded["rng"])
        else:
            warnings.warn(
                f"checkpoint {directory} was saved by {common['world_size']} ranks, this job has "
                f"{dist.get_world_size()}: random states start afresh",
                stacklevel=2,
            )
        for name, obj in self.extras.items():
            if name not in common["extras"]:
                raise ValueError(f"checkpoint {directory} has no state for {name!r}")
            obj.load_state_dict(common["extras"][name])
        trainer.step = common["step"]
        return common.get("iteration", common["step"])
