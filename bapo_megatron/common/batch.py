"""One step's rollout samples, and their file format (safetensors; never unpickled).

The rollout side writes a RolloutBatch per step (`save`), the trainer reads it
(`load`, `rollout.replay=PATH`), so training can be run and debugged without generation.
Every response token keeps the behaviour log-prob it was sampled with and the policy
version that sampled it (partial rollout mixes versions inside one response); a mixture-of-experts
model's samples may keep the experts the engine routed each position to (common/routes.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from bapo_megatron.common import protocol
from bapo_megatron.common.routes import RouteShape
from bapo_megatron.fsutil import publish, temporary_sibling
from bapo_megatron.models.spec import ModelSpec

FORMAT_VERSION = "1"
INTEGER_FIELDS = (
    "prompt_ids",
    "prompt_lengths",
    "response_ids",
    "response_lengths",
    "versions",
    "groups",
    "loss_mask",
    "routes",
    "route_positions",
)


class Group(Protocol):
    """A prompt's group of samples as the rollout side keeps it (rollout/buffer.py: GroupState)."""

    uid: str
    samples: list
    finished: bool


@dataclass
class Sample:
    """One response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    """log mu of each response token, as the engine reported it when sampling it."""
    versions: list[int]
    """The policy version that sampled each response token."""
    reward: float
    group: int
    """Which prompt group (the n samples of one prompt) this sample belongs to."""
    loss_mask: list[int] | None = None
    """Per response token: 0 leaves the token out of the loss (e.g. a stale prefix). None: all count."""
    routes: torch.Tensor | None = None
    """The engine's routed experts, [length - 1, moe_layers, top_k] (common/routes.py); None: not recorded."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in ("behaviour_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Sample.{name} has {len(getattr(self, name))} entries for {n} response tokens")
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"Sample.loss_mask has {len(self.loss_mask)} entries for {n} response tokens")
        if not self.prompt_ids:
            raise ValueError("Sample.prompt_ids is empty: a response needs at least one prompt token")
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] != self.length - 1):
            raise ValueError(
                f"Sample.routes has shape {tuple(self.routes.shape)}: expected [{self.length - 1}, moe_layers, top_k] "
                "(one route per position but the last)"
            )

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class RolloutBatch:
    """The samples of one step, with what the trainer must know about how they were sampled."""

    samples: list[Sample]
    temperature: float = 1.0
    """Sampling temperature: the trainer divides its logits by it, as the engine did."""
    metadata: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def problem(self, spec: ModelSpec) -> str | None:
        """What makes this batch untrainable by the model `spec` describes (None: nothing), as an
        engine's answer is checked on arrival (engines/client.py): token ids outside its vocabulary
        (rows past it are padding, which would train silently), log-probs that are none (non-finite,
        above 0), routes that are not its routers' choices (another count of MoE layers or top-k, an
        id past its experts: a failure inside Megatron's router once the model is built; an expert
        twice in a top-k: a route no router took, trained on); non-finite rewards or temperature."""
        if not self.samples:
            return "no samples"
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            return f"temperature {self.temperature!r}: must be finite and > 0"
        shape = RouteShape.of(spec) if spec.moe is not None else None
        for i, s in enumerate(self.samples):
            problem = _sample_problem(s, spec, shape)
            if problem:
                return f"sample {i}: {problem}"
        sizes: dict[int, int] = {}
        for s in self.samples:
            sizes[s.group] = sizes.get(s.group, 0) + 1
        if len(set(sizes.values())) > 1:
            counts = sorted(set(sizes.values()))
            return f"its groups have {counts} samples: every group needs the same number (advantages are per group)"
        return None

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[Group],
        temperature: float,
        metadata: dict[str, str] | None = None,
        loss_masks: Sequence[Sequence[list[int] | None]] | None = None,
        routes=None,
    ) -> RolloutBatch:
        """The batch a rollout step hands to training: every sample of each finished, rewarded group
        (group i of `groups` is group i of the batch), tokens with their behaviour log-probs and
        versions; loss_masks[i][j]: sample j of group i's loss mask (None: every token counts),
        such as the rollout's staleness bound leaves; routes: the RouteShape (common/routes.py) of the
        routed experts the samples recorded (a sample without all of them trains without). The
        groups' prompt uids go in the metadata."""
        samples = []
        for index, group in enumerate(groups):
            if not group.finished:
                raise ValueError(
                    f"group {group.uid!r} is not complete (every sample finished and rewarded): "
                    "only whole groups reach training"
                )
            masks = loss_masks[index] if loss_masks is not None else [None] * len(group.samples)
            for s, mask in zip(group.samples, masks, strict=True):
                samples.append(
                    Sample(
                        prompt_ids=list(s.prompt_ids),
                        response_ids=list(s.response_ids),
                        behaviour_logprobs=list(s.logprobs),
                        versions=list(s.versions),
                        reward=float(s.reward),
                        group=index,
                        loss_mask=mask,
                        routes=_recorded(routes, s),
                    )
                )
        meta = {"group_uids": json.dumps([g.uid for g in groups]), **(metadata or {})}
        return cls(samples=samples, temperature=temperature, metadata=meta)

    def rewards_by_group(self) -> tuple[list[int], torch.Tensor]:
        """(group ids in order of first appearance, rewards [groups, group_size]); equal-size groups only."""
        order: dict[int, list[int]] = {}
        for i, s in enumerate(self.samples):
            order.setdefault(s.group, []).append(i)
        sizes = {len(v) for v in order.values()}
        if len(sizes) > 1:
            raise ValueError(f"groups have unequal sizes {sorted(sizes)}: a group trains only when complete")
        rewards = torch.tensor([[self.samples[i].reward for i in idx] for idx in order.values()], dtype=torch.float32)
        return [i for idx in order.values() for i in idx], rewards

    def save(self, path: str | Path) -> None:
        """Write atomically (a temporary file renamed into place)."""
        from safetensors.torch import save_file

        tensors = {
            "prompt_ids": _flat([s.prompt_ids for s in self.samples], torch.int64),
            "prompt_lengths": torch.tensor([len(s.prompt_ids) for s in self.samples], dtype=torch.int64),
            "response_ids": _flat([s.response_ids for s in self.samples], torch.int64),
            "response_lengths": torch.tensor([len(s.response_ids) for s in self.samples], dtype=torch.int64),
            "behaviour_logprobs": _flat([s.behaviour_logprobs for s in self.samples], torch.float32),
            "versions": _flat([s.versions for s in self.samples], torch.int64),
            "loss_mask": _flat(
                [s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids) for s in self.samples],
                torch.uint8,
            ),
            "rewards": torch.tensor([s.reward for s in self.samples], dtype=torch.float32),
            "groups": torch.tensor([s.group for s in self.samples], dtype=torch.int64),
            **_routes_tensors(self.samples),
        }
        meta = {"format": FORMAT_VERSION, "temperature": repr(self.temperature), "metadata": json.dumps(self.metadata)}
        path = Path(path)
        tmp = temporary_sibling(path, directory=False)
        try:
            save_file(tensors, str(tmp), metadata=meta)
            publish(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> RolloutBatch:
        """Read a saved batch; ValueError naming the file for anything malformed."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"rollout batch {path}: no such file")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"rollout batch {path}: not a readable safetensors file ({err})") from None
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"rollout batch {path}: format {meta.get('format')!r}, expected {FORMAT_VERSION!r}")
        try:
            temperature = float(meta["temperature"])
        except (KeyError, ValueError):
            raise ValueError(f"rollout batch {path}: no sampling temperature in its metadata") from None
        for key in INTEGER_FIELDS:
            if key in t and (t[key].is_floating_point() or t[key].is_complex()):
                raise ValueError(f"rollout batch {path}: {key} has dtype {t[key].dtype}; it must hold integers")
        try:
            prompts = _split(t["prompt_ids"], t["prompt_lengths"])
            lengths = t["response_lengths"]
            responses = _split(t["response_ids"], lengths)
            logprobs = _split(t["behaviour_logprobs"], lengths)
            versions = _split(t["versions"], lengths)
            masks = _split(t["loss_mask"], lengths)
            routes = _split_routes(t, len(prompts))
            samples = [
                Sample(
                    prompt_ids=p,
                    response_ids=r,
                    behaviour_logprobs=lp,
                    versions=v,
                    reward=float(rw),
                    group=int(g),
                    loss_mask=m,
                    routes=ro,
                )
                for p, r, lp, v, m, rw, g, ro in zip(
                    prompts,
                    responses,
                    logprobs,
                    versions,
                    masks,
                    t["rewards"].tolist(),
                    t["groups"].tolist(),
                    routes,
                    strict=True,
                )
            ]
        except (KeyError, ValueError, RuntimeError) as err:
            raise ValueError(f"rollout batch {path}: inconsistent contents ({err})") from None
        try:
            metadata = json.loads(meta.get("metadata", "{}"))
        except ValueError:
            raise ValueError(f"rollout batch {path}: its metadata is not JSON") from None
        return cls(samples=samples, temperature=temperature, metadata=metadata)


def _sample_problem(s: Sample, spec: ModelSpec, shape: RouteShape | None) -> str | None:
    for part, ids in (("prompt", s.prompt_ids), ("response", s.response_ids)):
        problem = protocol.token_problem(ids, spec.vocab_size)
        if problem:
            return f"{part} {problem}"
    problem = protocol.logprob_problem(s.behaviour_logprobs)
    if problem:
        return f"behaviour {problem}"
    if s.routes is not None:
        if shape is None:
            return f"it carries routed experts, but the model ({spec.architecture}) has no experts"
        problem = shape.problem(s.routes)
        if problem:
            return problem
    return None if math.isfinite(s.reward) else f"reward {s.reward!r} is not finite"


def _recorded(shape, sample) -> torch.Tensor | None:
    """A rollout sample's routes when it recorded one for every position but the last."""
    if shape is None or not getattr(sample, "routes", b""):
        return None
    routes = shape.from_bytes(sample.routes)
    return routes if len(routes) == len(sample.prompt_ids) + len(sample.response_ids) - 1 else None


def _routes_tensors(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The samples' routes, concatenated over positions, and each one's count of positions (0: none)."""
    kept = [s.routes for s in samples if s.routes is not None]
    if not kept:
        return {}
    return {
        "routes": torch.cat(kept),
        "route_positions": torch.tensor([0 if s.routes is None else len(s.routes) for s in samples]),
    }


def _split_routes(t: dict[str, torch.Tensor], n: int) -> list[torch.Tensor | None]:
    if "routes" not in t:
        return [None] * n
    counts = t["route_positions"].tolist()
    if len(counts) != n or sum(counts) != t["routes"].shape[0] or t["routes"].dim() != 3:
        raise ValueError(f"routes of shape {tuple(t['routes'].shape)} do not split into positions {counts}")
    parts = torch.split(t["routes"], counts)
    return [part.clone() if count else None for part, count in zip(parts, counts, strict=True)]


def _flat(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=dtype)


def _split(flat: torch.Tensor, lengths: torch.Tensor) -> list[list]:
    if int(lengths.sum()) != flat.numel():
        raise ValueError(f"{flat.numel()} values for lengths summing to {int(lengths.sum())}")
    return [part.tolist() for part in torch.split(flat, lengths.tolist())]
