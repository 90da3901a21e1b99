"""Rank 0's side of the online loop: the engines, the prompts, the rewards and the weight sync.

    driver = RolloutDriver(cfg, spec, run_dir)      # data, reward and tokenizer checked here
    driver.start(model_dir)                         # engines started (or connected) and ready
    driver.sync(buckets, version)                   # every engine now serves `version`
    batch, metrics = driver.rollout(version)        # one step's whole groups, rewarded
    driver.close()                                  # engines stopped, workers closed

Engines: `rollout.engine_urls` are connected to; otherwise `rollout.servers` engines are
started (embedded on loopback with a generated admin key, or SGLang by its launcher) and
stopped at close; a started engine dies with this process (parent-death signal), so a killed
driver leaves none behind. Weights travel over a weight-update group from rank 0, or by
handle to colocated engines, whose memory is released while the trainer runs. After every
sync each engine's weight version is checked against the trainer's.

Everything asynchronous runs on one event loop owned by the driver (retract mode keeps
requests in flight across steps, so the loop outlives each call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.common.model_spec import ModelSpec
from bapo_megatron.common.progress import Progress, bars_on
from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.config import JobConfig
from bapo_megatron.errors import BadInputError, ConfigError, RunStopped
from bapo_megatron.rollout.client import EngineClient, EngineError, EngineUnavailable
from bapo_megatron.rollout.data import PromptSource
from bapo_megatron.rollout.launcher import ServerProcess, embedded_servers, free_port
from bapo_megatron.rollout.manager import EnginePool, RolloutManager
from bapo_megatron.rollout.partial import PartialRolloutBuffer
from bapo_megatron.rollout.rewards import RewardWorkers, load_reward

PROBE_TOKENS = 16
BUSY_METRIC = "bapo_engine_busy_seconds_total"


def load_tokenizer(model_dir: str | Path | None):
    """The model directory's tokenizer, or None when it has none. tokenizer.json is read as it is
    (transformers' PreTrainedTokenizerFast), with the chat template and special tokens that
    tokenizer_config.json (or chat_template.jinja) names: AutoTokenizer would pick a class from
    config.json's model type and may rebuild the tokenizer its own way."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    import transformers

    if (root / "tokenizer.json").is_file():
        config_file = root / "tokenizer_config.json"
        extra = json.loads(config_file.read_text()) if config_file.is_file() else {}
        kwargs = {k: v for k, v in extra.items() if k in SPECIAL_TOKENS and isinstance(v, str)}
        if isinstance(extra.get("chat_template"), str):
            kwargs["chat_template"] = extra["chat_template"]
        elif (root / "chat_template.jinja").is_file():
            kwargs["chat_template"] = (root / "chat_template.jinja").read_text()
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), **kwargs)
    if (root / "tokenizer_config.json").is_file():  # a tokenizer of vocabulary files only
        return transformers.AutoTokenizer.from_pretrained(str(root))
    return None


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def check_port(host: str, port: int, field: str) -> None:
    """ConfigError when (host, port) cannot be listened on (in use, or not this machine's)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(field, port, f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def spec_difference(spec: ModelSpec, other: ModelSpec) -> str | None:
    """The first shape field in which two specs differ, as text (None: same shape)."""
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
        if getattr(spec, name) != getattr(other, name):
            return f"{name} {getattr(other, name)} (the trainer's is {getattr(spec, name)})"
    return None


class RolloutDriver:
    def __init__(self, cfg: JobConfig, spec: ModelSpec, run_dir: Path) -> None:
        """Everything that can be checked without an engine or a model, checked: the dataset (every
        record), the reward (imported), the tokenizer (against the model's vocabulary), the ports."""
        ro, data = cfg.rollout, cfg.data
        self.cfg, self.spec, self.run_dir = cfg, spec, Path(run_dir)
        if data.path is None:
            raise ConfigError("data.path", None, "generation needs prompts: a jsonl or parquet file")
        self.tokenizer = load_tokenizer(cfg.model.hf_path)
        if self.tokenizer is not None and len(self.tokenizer) > spec.vocab_size:
            raise BadInputError(
                f"model.hf_path={cfg.model.hf_path}: the tokenizer has {len(self.tokenizer)} tokens, more than "
                f"the model's vocabulary of {spec.vocab_size}"
            )
        try:
            load_reward(data.reward)
        except ValueError as err:
            raise ConfigError("data.reward", data.reward, str(err)) from None
        try:
            self.prompts = PromptSource(data, self._tokenize if self.tokenizer is not None else None)
        except ValueError as err:
            raise ConfigError("data.path", data.path, str(err)) from None
        self._check_prompts("data.path", data.path, self.prompts.items)
        self.eval_items: list[tuple[list[int], dict[str, Any]]] = []
        if cfg.eval.path is not None:
            held = dataclasses.replace(data, path=cfg.eval.path, shuffle=False)
            try:
                self.eval_items = PromptSource(held, self._tokenize if self.tokenizer is not None else None).items
            except ValueError as err:
                raise ConfigError("eval.path", cfg.eval.path, str(err)) from None
            self.eval_items = self.eval_items[: cfg.eval.max_prompts]
            self._check_prompts("eval.path", cfg.eval.path, self.eval_items)
        self.base_gpus = self._sglang_placement() if ro.engine == "sglang" and not ro.engine_urls else None
        if not ro.engine_urls:
            host = "127.0.0.1" if ro.engine == "embedded" else ro.host
            for i in range(ro.servers):
                check_port(host, ro.port + i, "rollout.port")
        self.buffer = PartialRolloutBuffer(
            ro.samples_per_prompt,
            ro.max_new_tokens,
            ro.token_budget if ro.partial else None,
            ro.max_staleness,
        )
        self.rewards = RewardWorkers(data.reward, data.reward_workers)  # processes start at the first score
        self.loop = asyncio.new_event_loop()
        self.servers: list[ServerProcess] = []
        self.clients: list[EngineClient] = []
        self.key: str | None = None
        self.manager: RolloutManager | None = None
        self.progress = bars_on(cfg.logging.progress)
        self.sender = None
        self._busy: tuple[float, list[float]] | None = None
        self._released = False
        if ro.engine_urls:  # engines of another job: they answer and serve this shape, or nothing starts
            from bapo_megatron.rollout.sglang_launcher import KEY_ENV, admin_key

            given = ro.admin_key_file or os.environ.get(KEY_ENV)
            self.key = admin_key(ro, self.run_dir) if given else None  # theirs: never one generated here
            self.clients = [EngineClient(url, self.key, timeout_s=ro.request_timeout_s) for url in ro.engine_urls]
            try:
                self._run(self._check_engines())
            except BaseException:
                self.close()
                raise

    def _check_prompts(self, name: str, path: str, items: list[tuple[list[int], dict[str, Any]]]) -> None:
        """Every prompt leaves room for rollout.max_new_tokens and holds only the model's token ids."""
        spec, new = self.spec, self.cfg.rollout.max_new_tokens
        too_long = [i for i, (ids, _) in enumerate(items) if len(ids) + new > spec.max_position_embeddings]
        if too_long:
            raise BadInputError(
                f"{name}={path} record {too_long[0] + 1}: prompt + rollout.max_new_tokens exceed the "
                f"model's context of {spec.max_position_embeddings} tokens"
            )
        bad_ids = [i for i, (ids, _) in enumerate(items) if any(not 0 <= t < spec.vocab_size for t in ids)]
        if bad_ids:
            raise BadInputError(
                f"{name}={path} record {bad_ids[0] + 1}: a token id outside the model's vocabulary "
                f"[0, {spec.vocab_size})"
            )

    def _tokenize(self, text: str) -> list[int]:
        if self.cfg.data.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )  # the template writes any special tokens itself: encoded as they are
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _run(self, coro):
        """Run `coro` on the driver's loop. Ctrl-C meanwhile cancels it (so every request task unwinds
        at an await, never mid-call) and is raised as KeyboardInterrupt once it has."""
        task = self.loop.create_task(coro)
        interrupted = False

        def interrupt() -> None:
            nonlocal interrupted
            interrupted = True
            task.cancel()

        main = threading.current_thread() is threading.main_thread()
        if main:
            self.loop.add_signal_handler(signal.SIGINT, interrupt)
        try:
            return self.loop.run_until_complete(task)
        except asyncio.CancelledError:
            if interrupted:
                raise KeyboardInterrupt from None
            raise
        finally:
            if main:
                self.loop.remove_signal_handler(signal.SIGINT)

    # ------------------------------------------------------------------------------------------
    # Engines.

    def start(self, model_dir: str | Path, holders=None) -> None:
        """Start the engines on `model_dir` (or connect to rollout.engine_urls) and wait until every one
        answers; then build the rollout manager and the weight sender (colocated on several GPUs,
        `holders`: weights/sync.HandleHolders)."""
        ro = self.cfg.rollout
        if ro.engine_urls:
            urls, key = list(ro.engine_urls), self.key
        elif ro.engine == "embedded":
            key = secrets.token_urlsafe(32)
            self.servers = embedded_servers(ro, model_dir, self.run_dir, self.cfg.seed, key)
            for server in self.servers:
                server.start()
            urls = [s.url for s in self.servers]
        else:
            from bapo_megatron.rollout.sglang_launcher import start_sglang

            fraction = self._colocated_fraction() if ro.colocate and ro.mem_fraction_static is None else None
            self.servers, key = start_sglang(
                ro,
                str(model_dir),
                self.run_dir,
                ro.startup_timeout_s,
                seed=self.cfg.seed,
                colocated_fraction=fraction,
                base_gpus=self.base_gpus,
            )
            urls = [s.url for s in self.servers]
        for server in self.servers:
            server.wait_ready(ro.startup_timeout_s)
        if not ro.engine_urls:
            self.clients = [EngineClient(url, admin_key=key, timeout_s=ro.request_timeout_s) for url in urls]
        self.manager = RolloutManager(
            EnginePool(self.clients, timeout_s=ro.startup_timeout_s),
            self.buffer,
            self.prompts.next,
            self.rewards,
            SamplingParams(ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k),
            ro.prompts_per_step,
            oversample=ro.oversample,
            partial=ro.partial,
            decode=self._decode,
            mode=ro.partial_mode if ro.partial else "abort",
            deterministic_seed=self.cfg.seed if ro.deterministic else None,
        )
        self.sender = self._weight_sender(holders)

    def _sglang_placement(self) -> list[int]:
        """SGLang servers to start here: SGLang installed, GPUs on this node, and each server's
        first GPU beside the trainer's ranks here (sglang_launcher.gpu_placement); else a
        ConfigError, before any model is built."""
        import torch

        from bapo_megatron.rollout.sglang_launcher import check_installed, gpu_placement
        from bapo_megatron.trainer.parallel import local_world_size

        ro = self.cfg.rollout
        try:
            check_installed()
        except ValueError as err:
            raise ConfigError("rollout.engine", ro.engine, str(err)) from None
        gpus = torch.cuda.device_count()
        if not gpus:
            raise ConfigError(
                "rollout.engine", ro.engine, "SGLang runs on CUDA GPUs and this machine has none (embedded runs on CPU)"
            )
        try:
            return gpu_placement(ro, local_world_size(), gpus)
        except ValueError as err:
            raise ConfigError("rollout.servers", ro.servers, str(err)) from None

    def _colocated_fraction(self) -> float:
        """What a colocated SGLang server may take of this GPU beside a trainer rank (cli.rollout_mem_fraction)."""
        import torch

        from bapo_megatron.cli import rollout_mem_fraction

        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp = self.cfg.parallel.data_parallel_size(world)
        return rollout_mem_fraction(self.cfg, self.spec, torch.cuda.get_device_properties(0).total_memory, dp)

    async def _check_engines(self) -> None:
        """Engines that are already running answer, and serve a model of the trainer's shape."""
        for client in self.clients:
            try:
                async with EngineClient(client.base_url, self.key, timeout_s=30, retries=1) as quick:
                    info = await quick.model_info()
            except (EngineUnavailable, EngineError) as err:
                raise ConfigError("rollout.engine_urls", client.base_url, f"does not answer: {err}") from None
            served = Path(str(info.get("model_path", "")))
            if (served / "config.json").is_file():
                problem = spec_difference(self.spec, ModelSpec.from_hf_dir(served))
                if problem:
                    raise ConfigError(
                        "rollout.engine_urls", client.base_url, f"serves {served}, whose shape differs: {problem}"
                    )

    def _weight_sender(self, holders=None):
        from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender

        ro = self.cfg.rollout
        if ro.colocate:
            return TensorWeightSender(self.clients, engine_tp=ro.tensor_parallel, holders=holders)
        host = ro.sync_host or ("127.0.0.1" if not ro.engine_urls else socket.getfqdn())
        ranks = [ro.tensor_parallel] * len(self.clients)
        sender = DistributedWeightSender(self.clients, ranks, host, free_port(host), timeout_s=ro.startup_timeout_s)
        self._run(sender.connect())
        return sender

    # ------------------------------------------------------------------------------------------
    # One step.

    def rollout(self, version: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate until rollout.prompts_per_step groups are complete; the batch and its metrics."""
        groups_wanted = self.cfg.rollout.prompts_per_step
        with Progress(groups_wanted, f"rollout {version}", unit="group", enabled=self.progress) as bar:
            self.manager.on_progress = lambda groups, tokens: bar.reach(groups, f"{tokens / bar.seconds:,.0f} tok/s")
            groups = self._run(self.manager.step(version))
        batch = RolloutBatch.from_groups(
            groups, self.cfg.rollout.temperature, self.cfg.rollout.mask_stale_prefix, {"version": str(version)}
        )
        stats = dict(self.manager.stats)
        rewards = [s.reward for s in batch.samples]
        lengths = [len(s.response_ids) for s in batch.samples]
        stale = [version - v for s in batch.samples for v in s.versions]
        stats.update(
            {
                "rollout/reward_mean": sum(rewards) / len(rewards),
                "rollout/response_length": sum(lengths) / len(lengths),
                "rollout/truncated": sum(s_len >= self.cfg.rollout.max_new_tokens for s_len in lengths) / len(lengths),
                "rollout/token_staleness": sum(stale) / max(1, len(stale)),
                "rollout/token_staleness_max": float(max(stale, default=0)),
            }
        )
        return batch, stats

    def release_memory(self) -> None:
        """Colocated engines free their memory while the trainer runs (abort mode: nothing generates)."""
        if self.cfg.rollout.colocate:
            self._run(self.manager.release_memory())
            self._released = True

    def sync(self, buckets: Iterable, version: int) -> dict[str, float]:
        """Every bucket to every engine as weight version `version`; then each engine's version checked."""
        released = self._released  # colocated, after a rollout: the engines hold no memory now
        start = time.monotonic()

        async def go() -> int:
            async with self.manager.weight_update():
                if released:
                    await self.manager.resume_memory(["weights"])
                sent = await self.sender.send(buckets, str(version))
                if released:
                    await self.manager.resume_memory(["kv_cache", "cuda_graph"])
            for client in self.clients:
                served = (await client.model_info()).get("weight_version")
                if str(served) != str(version):
                    raise RunStopped(
                        f"weight sync: {client.base_url} reports weight version {served!r} after the sync of "
                        f"version {version}: its weights are not the trainer's"
                    )
            return sent

        sent = self._run(go())
        self._released = False
        return {"time/weight_sync": time.monotonic() - start, "sync/bytes": float(sent)}

    def probe(self) -> Sample:
        """A fixed response (the first prompt, sampled with a fixed seed) with the engine's log-probs."""
        ids, _ = self.prompts.items[0]
        sampling = SamplingParams(
            max_new_tokens=min(PROBE_TOKENS, self.cfg.rollout.max_new_tokens),
            temperature=self.cfg.rollout.temperature,
            ignore_eos=True,
            sampling_seed=self.cfg.seed,
        )
        completion = self._run(self.clients[0].generate(list(ids), sampling, f"probe-{secrets.token_hex(4)}"))
        return Sample(
            prompt_ids=list(ids),
            response_ids=completion.output_ids,
            behaviour_logprobs=completion.logprobs,
            versions=[0] * len(completion.output_ids),
            reward=0.0,
            group=0,
        )

    def evaluate(self) -> dict[str, float]:
        """The engines' current policy on eval.path, no gradient: eval/greedy_acc (mean reward of one
        greedy answer a prompt), eval/avg@k (mean reward of k samples at rollout.temperature) and
        eval/pass@k (mean over prompts of the best of the k; the share solved for 0/1 rewards).
        Sampling seeds depend on the prompt and sample only, so evaluations differ by the weights."""
        ev, ro = self.cfg.eval, self.cfg.rollout
        if not self.eval_items:
            return {}
        if self._released:
            raise RuntimeError("evaluate() while the engines' memory is released (sync first)")
        start = time.monotonic()
        slots = asyncio.Semaphore(ro.engine_max_batch * len(self.clients))

        async def one(i: int, j: int, sampling: SamplingParams) -> tuple[int, int, float, int]:
            ids, meta = self.eval_items[i]
            async with slots:
                done = await self.clients[i % len(self.clients)].generate(
                    list(ids), sampling, f"eval-{i}-{j}-{secrets.token_hex(4)}"
                )
            reward = await self.rewards(self._decode(done.output_ids), done.output_ids, meta)
            return i, j, reward, len(done.output_ids)

        async def go():
            jobs = []
            for i in range(len(self.eval_items)):
                if ev.greedy:
                    jobs.append(one(i, -1, SamplingParams(ro.max_new_tokens, temperature=0.0)))
                for j in range(ev.samples):
                    seed = (self.cfg.seed * 1_000_003 + i * 1_009 + j) % 2**31
                    sampling = SamplingParams(
                        ro.max_new_tokens,
                        temperature=ro.temperature,
                        top_p=ro.top_p,
                        top_k=ro.top_k,
                        sampling_seed=seed,
                    )
                    jobs.append(one(i, j, sampling))
            return await asyncio.gather(*jobs)

        results = self._run(go())
        n, k = len(self.eval_items), ev.samples
        out = {"eval/prompts": float(n), "eval/response_length": sum(r[3] for r in results) / len(results)}
        if ev.greedy:
            out["eval/greedy_acc"] = sum(r[2] for r in results if r[1] < 0) / n
        if k:
            sampled: dict[int, list[float]] = {}
            for i, j, reward, _ in results:
                if j >= 0:
                    sampled.setdefault(i, []).append(reward)
            out[f"eval/avg@{k}"] = sum(sum(v) / k for v in sampled.values()) / n
            out[f"eval/pass@{k}"] = sum(max(v) for v in sampled.values()) / n
        out["time/eval"] = time.monotonic() - start
        return out

    def engine_stats(self) -> dict[str, float]:
        """engine/busy_share: the share of the wall time since the last call that the engines spent
        computing (averaged over engines; from their /metrics, where they export busy seconds)."""

        async def busy() -> list[float]:
            found = await asyncio.gather(*(c.metrics() for c in self.clients), return_exceptions=True)
            return [m.get(BUSY_METRIC) for m in found if isinstance(m, dict) and BUSY_METRIC in m]

        now, seconds = time.monotonic(), self._run(busy())
        last, self._busy = self._busy, (now, seconds)
        if last is None or len(last[1]) != len(seconds) or not seconds or now <= last[0]:
            return {}
        share = sum(b - a for a, b in zip(last[1], seconds, strict=True)) / (len(seconds) * (now - last[0]))
        return {"engine/busy_share": share}

    def drain(self, version: int) -> None:
        """Retract mode: requests still in the engines are aborted and their output kept (before a save)."""
        if self.manager is not None and self.manager.retract:
            self._run(self.manager.drain(version))

    # ------------------------------------------------------------------------------------------
    # The run's state and the end.

    def state_dict(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer.state_dict(),
            "prompts": self.prompts.state_dict(),
            "rewards": self.rewards.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.prompts.load_state_dict(state["prompts"])
        self.rewards.load_state_dict(state["rewards"])

    def close(self) -> None:
        """Stop what this driver started; safe to call more than once and after a failed start."""
        if self.loop.is_closed():
            return
        try:
            pending = asyncio.all_tasks(self.loop)  # requests of a step cut short (an error, Ctrl-C)
            for task in pending:
                task.cancel()
            if pending:
                self._run(asyncio.gather(*pending, return_exceptions=True))
            if self.sender is not None and hasattr(self.sender, "close"):
                self._run(asyncio.wait_for(self.sender.close(), 30))
        except Exception:  # the engines may be gone already: their end of the group is gone too
            pass
        finally:
            self.sender = None
            for client in self.clients:
                self._run(client.close())
            self.clients = []
            self.rewards.close()
            for server in self.servers:
                server.stop()
            self.servers = []
            if not self.loop.is_closed():
                self.loop.close()


def write_samples_log(path: Path, step: int, batch: RolloutBatch) -> None:
    """Which prompt groups step `step` trained on (one jsonl line): their uids are unique in one run."""
    with path.open("a") as f:
        f.write(json.dumps({"step": step, "groups": json.loads(batch.metadata["group_uids"])}) + "\n")
