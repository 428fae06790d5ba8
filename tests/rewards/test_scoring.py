"""Scoring programs in fresh sandboxes: nothing leaks, and a failed sandbox is no score at all."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rollbox.envs import AsyncSandboxEnv, Task
from rollbox.errors import ConfigError, SandboxDeadError, SandboxStartError
from rollbox.rewards import CodeBlock, PythonTests, score_program, score_programs
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers

SQUARE = PythonTests(tests="assert square(3) == 9\nassert square(-2) == 4\n", entry_point="square")


async def test_each_program_gets_its_own_sandbox_which_is_then_gone(
    provider: LocalProvider,
) -> None:
    programs = [
        "def square(x):\n    return x * x\n",
        "def square(x):\n    return x\n",
        "syntax error(",
    ]
    results = await score_programs(programs, SQUARE, n_concurrent=2, provider=provider)
    assert [r.score for r in results if r is not None] == [1.0, 0.0, 0.0]
    ids = {r.details["sandbox_id"] for r in results if r is not None}
    assert len(ids) == 3
    assert await provider.list() == []
    assert_no_leftovers(ids)


async def test_text_rewards_start_no_sandbox(provider: LocalProvider) -> None:
    result = await score_program("", CodeBlock(), completion="```\nx\n```", provider=provider)
    assert result.score == 1.0 and "sandbox_id" not in result.details


async def test_a_provider_that_cannot_start_sandboxes_gives_none_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed = LocalProvider()
    await closed.close()
    with caplog.at_level(logging.ERROR, logger="rollbox.rewards"):
        results = await score_programs(
            ["def square(x):\n    return x * x\n"] * 2, SQUARE, provider=closed
        )
    assert results == [None, None]
    assert "no score for sample 0, the sandbox failed" in caplog.text
    assert "SandboxStartError: this LocalProvider is closed" in caplog.text
    with pytest.raises(SandboxStartError):
        await score_program("", SQUARE, provider=closed)


async def test_a_sandbox_that_dies_mid_scoring_gives_none(provider: LocalProvider) -> None:
    slow = "import time\ndef square(x):\n    time.sleep(30)\n"

    async def kill_it() -> None:
        while not await provider.list():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        for info in await provider.list():
            await (await provider.get(info.id)).kill()

    killer = asyncio.create_task(kill_it())
    results = await score_programs([slow], SQUARE, provider=provider)
    await killer
    assert results == [None]
    with pytest.raises(SandboxDeadError):
        killer = asyncio.create_task(kill_it())
        try:
            await score_program(slow, SQUARE, provider=provider)
        finally:
            await killer


async def test_a_configuration_error_raises_and_stops_the_batch(provider: LocalProvider) -> None:
    reward = PythonTests(tests="assert f() == 1", entry_point="not valid")
    with pytest.raises(ConfigError, match="entry_point must be a Python name"):
        await score_programs(["x"] * 4, reward, n_concurrent=2, provider=provider)
    await asyncio.sleep(0)
    assert await provider.list() == []


async def test_a_reward_is_a_task_verifier(provider: LocalProvider) -> None:
    task = Task(id="square", instruction="Write square() in /work/solution.py", verifier=SQUARE)
    async with AsyncSandboxEnv(task, provider=provider) as env:
        await env.reset()
        await env.step(
            {
                "tool": "write_file",
                "path": "solution.py",
                "content": "def square(x):\n    return x * x\n",
            }
        )
        # a process the agent leaves behind, which would rewrite the solution during the tests
        await env.step(
            "setsid sh -c 'sleep 0.2; echo \"def square(x): return 0\" > /work/solution.py' >/dev/null 2>&1 &"
        )
        _, reward, terminated, _, info = await env.step({"tool": "submit"})
    assert (reward, terminated) == (1.0, True)
    assert info["reward_components"] == {"python_tests": 1.0}
    assert len(info["verifier"]["passed"]) == 2
