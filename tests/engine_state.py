"""Wait for an engine's state (its /metrics), never for wall time: a test that sleeps and then
assumes the engine has got somewhere fails on a busy machine."""

import asyncio

PREFIX = "bapo_engine_"


async def until(client, condition, what: str, limit_s: float = 600.0) -> dict[str, float]:
    """Poll the engine's /metrics until condition(metrics) holds (names without the prefix)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s  # a hang guard only: the condition is what is waited for
    while True:
        metrics = {k.removeprefix(PREFIX): v for k, v in (await client.metrics()).items()}
        if condition(metrics):
            return metrics
        if loop.time() > deadline:
            raise AssertionError(f"the engine never reached: {what} ({metrics})")
        await asyncio.sleep(0.01)


async def generating(client, at_least: int = 1) -> dict[str, float]:
    """Until a request is running and has produced at least `at_least` tokens since the call."""
    start = (await until(client, lambda m: True, "metrics"))["decode_tokens_total"]
    return await until(
        client,
        lambda m: m["running_requests"] >= 1 and m["decode_tokens_total"] >= start + at_least,
        f"{at_least} decoded tokens",
    )
