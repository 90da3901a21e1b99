"""Partial rollout against the embedded engine: versions and log-probs per token across three
weight versions, staleness drops, and a rollout step that survives its engine being killed."""

import asyncio

import pytest
import torch

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.client import EngineClient
from bapo_megatron.engines.launcher import embedded_server
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.engines.supervisor import Supervisor
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.buffer import RolloutBuffer
from bapo_megatron.rollout.core import RolloutCore
from bapo_megatron.rollout.strategies import AbortSteps, RetractSteps
from tests.engine_state import generating
from tests.helpers import make_hf_model

pytestmark = pytest.mark.e2e
MODELS = ("model-a", "model-bb", "model-ccc")  # same shape, different weights (the seed is the name's length)
LONG = 600  # tokens per sample in the kill test: the engine is killed once 8 are decoded
RETRACT_LONG = 800  # the retract test: a group must outlast two weight updates, each after 4 more tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    return {name: (root / name, make_hf_model(root, name, ("qwen2", 2, False))) for name in MODELS}


def _token_logprobs(model, prompt, response, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


async def _round(client, buffer, version):
    buffer.drop_stale(version)
    for req in buffer.begin_requests():
        sampling = SamplingParams(max_new_tokens=req.max_new_tokens, temperature=1.0, ignore_eos=True)
        buffer.record(req, await client.generate(req.input_ids, sampling, req.sample.uid + f"@{version}"), version)


def test_tokens_keep_the_version_and_logprob_they_were_sampled_with(models, tmp_path):
    server = embedded_server(models[MODELS[0]][0], tmp_path / "engine.log").start().wait_ready(120)
    try:

        async def run():
            async with EngineClient(server.url) as client:
                buffer = RolloutBuffer(samples_per_prompt=2, max_new_tokens=12, token_budget=4, max_staleness=2)
                for i in range(2):
                    buffer.add_group(f"p{i}", [10 + i, 20 + i, 30 + i])
                for version, name in enumerate(MODELS, start=1):
                    await client.update_weights_from_disk(str(models[name][0]), str(version))
                    await _round(client, buffer, version)
                kept = [s for g in buffer.groups.values() for s in g.samples]
                drops_before = buffer.counters["dropped_stale"]
                stale = RolloutBuffer(samples_per_prompt=2, max_new_tokens=12, token_budget=4, max_staleness=1)
                stale.add_group("q", [5, 6, 7])
                for version in (1, 2):
                    await client.update_weight_version(str(version))
                    await _round(client, stale, version)  # tokens of versions 1 and 2
                stale.drop_stale(3)  # 3 - 1 > 1: both samples dropped, restarted from the prompt
                requests = stale.begin_requests()
                return kept, drops_before, stale.counters["dropped_stale"], requests

        kept, drops_before, drops, requests = asyncio.run(run())
    finally:
        server.stop()
    assert drops_before == 0 and drops == 2 and all(r.input_ids == [5, 6, 7] for r in requests)
    for sample in kept:
        assert sample.finished and sample.versions == [1] * 4 + [2] * 4 + [3] * 4
        got = torch.tensor(sample.logprobs)
        for version, name in enumerate(MODELS, start=1):
            want = _token_logprobs(models[name][1], sample.prompt_ids, sample.response_ids)
            sel = torch.tensor(sample.versions) == version
            torch.testing.assert_close(got[sel], want[sel], rtol=0, atol=1e-5)


def test_step_survives_a_killed_engine_that_its_supervisor_restarts(models, tmp_path):
    """A step whose only engine is killed mid-request: the supervisor starts it again on its port,
    it waits for the weights (never picked before), then the step finishes with every sample whole
    and every log-prob the one its token was sampled with."""
    path, model = models[MODELS[0]]
    server = embedded_server(path, tmp_path / "engine.log").start().wait_ready(120)
    counter = iter(range(100))

    def prompts():
        i = next(counter)
        return f"p{i}", [3 + i, 4 + i, 5 + i], {"answer_ids": [1]}

    async def run():
        async with EngineClient(server.url, retries=1, backoff_s=0.2) as client:
            pool = EnginePool([client], wait_s=120, probe_s=0.2)
            buffer = RolloutBuffer(samples_per_prompt=2, max_new_tokens=LONG)
            core = RolloutCore(
                pool,
                buffer,
                prompts,
                RewardWorkers("exact_ids", inline=True),
                SamplingParams(max_new_tokens=LONG, ignore_eos=True),
            )
            supervisor = Supervisor(pool, [server], max_restarts=2, startup_timeout_s=120, probe_s=0.1)
            await supervisor.start()
            step = asyncio.create_task(AbortSteps(core, prompts_per_step=2).batch(0))
            await generating(client, at_least=8)  # the step's requests are in the engine, part-way
            assert not step.done(), "the step finished before the engine could be killed: make it longer"
            killed = server.process.pid
            server.kill()
            try:
                while not pool.refitting:  # marked dead, restarted on the same port
                    assert not step.done()
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                assert not pool.live() and not step.done()  # not picked until it has the weights
                pid = server.process.pid
                pool.revive(0)  # (the driver's refit: here the restart's weights are the policy's, version 0)
                groups, stats = await step
            finally:
                await supervisor.close()
                server.stop()
            return groups, pool.failures, stats, supervisor.restarts, (killed, pid)

    groups, failures, stats, restarts, (killed, pid) = asyncio.run(run())  # the restart is awaited: no time bound
    assert failures >= 1 and stats["rollout/engine_failures"] >= 1 and restarts == 1 and pid != killed
    assert sorted(g.uid for g in groups) == ["p0", "p1"]
    uids = [s.uid for g in groups for s in g.samples]
    assert len(uids) == len(set(uids)) == 4
    for g in groups:
        for s in g.samples:
            assert s.finished and len(s.response_ids) == len(s.logprobs) == len(s.versions) == LONG
            assert s.reward == 0.0
            want = _token_logprobs(model, s.prompt_ids, s.response_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), want, rtol=0, atol=1e-5)


def test_retract_mode_keeps_requests_in_the_engine_across_updates(models, tmp_path):
    """Retract mode: requests outlive the step that sent them and continue, inside the engine,
    under each new version (every token's version and log-prob are the ones it was sampled
    with), also when the engine's memory is released and resumed around an update as a
    colocated trainer does; a request sent too many versions ago is aborted and its sample regenerated; drain
    keeps what was generated. The engine runs two requests at a time, so one group generates
    while the other waits: which requests are in flight at each point is deterministic."""
    server = embedded_server(models[MODELS[0]][0], tmp_path / "engine.log", max_batch=2).start().wait_ready(120)
    counter = iter(range(100))

    def prompts():
        i = next(counter)
        return f"p{i}", [3 + i, 4 + i, 5 + i], {"answer_ids": [1]}

    def model_dir(version):
        return str(models[MODELS[(version - 1) % 3]][0])

    async def run():
        async with EngineClient(server.url) as client:
            buffer = RolloutBuffer(samples_per_prompt=2, max_new_tokens=RETRACT_LONG, max_staleness=2)
            pool = EnginePool([client])
            core = RolloutCore(
                pool,
                buffer,
                prompts,
                RewardWorkers("exact_ids", inline=True),
                SamplingParams(max_new_tokens=RETRACT_LONG, ignore_eos=True),
            )
            steps = RetractSteps(core, prompts_per_step=1, oversample=2)

            async def update(version):
                await generating(client, at_least=4)  # some tokens under the version before
                async with steps.paused(version):
                    colocated = version % 2  # as a colocated trainer: the engine's memory is free meanwhile
                    if colocated:
                        await pool.each(lambda c: c.release_memory())
                        await pool.each(lambda c: c.resume_memory(["weights"]))
                    await client.update_weights_from_disk(model_dir(version), str(version))
                    if colocated:
                        await pool.each(lambda c: c.resume_memory(["kv_cache", "cuda_graph"]))

            await client.update_weight_version("1")
            first, stats = await steps.batch(1)  # p0 done; p1 sent under version 1, generating
            in_engines = stats["rollout/in_engines"]
            await update(2)
            await update(3)
            second, _ = await steps.batch(3)  # p1, finished under versions 1-3; p2 sent at 3
            await update(4)
            await update(5)
            await update(6)
            third, _ = await steps.batch(6)  # p2 sent at 3: 6 - 3 > 2, aborted and regenerated
            dropped = buffer.counters["dropped_stale"]
            before = sum(len(s.response_ids) for s in buffer.samples())
            await steps.drain()
            drained = sum(len(s.response_ids) for s in buffer.samples()) - before
            return first, in_engines, second, third, dropped, drained, core, buffer

    try:
        first, in_engines, second, third, dropped, drained, core, buffer = asyncio.run(run())
    finally:
        server.stop()
    assert [g.uid for g in first] == ["p0"] and in_engines == 2
    assert [g.uid for g in second] == ["p1"] and [g.uid for g in third] == ["p2"]
    assert dropped == 2 and all(s.regenerated == 1 and set(s.versions) == {6} for s in third[0].samples)
    spanning = [s for s in second[0].samples if set(s.versions) == {1, 2, 3}]
    assert spanning, f"p1 should have tokens of versions 1-3: {[sorted(set(s.versions)) for s in second[0].samples]}"
    assert drained > 0 and not core.running and set(buffer.groups) == {"p3"}
    for group in first + second + third:
        for s in group.samples:
            assert s.finished and len(s.response_ids) == len(s.logprobs) == len(s.versions) == RETRACT_LONG
            assert s.versions == sorted(s.versions)
            got, versions = torch.tensor(s.logprobs), torch.tensor(s.versions)
            for version in set(s.versions):
                name = MODELS[(version - 1) % 3]
                want = _token_logprobs(models[name][1], s.prompt_ids, s.response_ids)
                torch.testing.assert_close(got[versions == version], want[versions == version], rtol=0, atol=1e-5)
