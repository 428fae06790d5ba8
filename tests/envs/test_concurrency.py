"""Hundreds of episodes at once through the async core, and nothing left behind."""

from __future__ import annotations

import asyncio

from rollbox.envs import AsyncSandboxEnv
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers
from tests.envs.conftest import answer_task

EPISODES = 200


async def test_200_concurrent_episodes_leave_nothing(provider: LocalProvider) -> None:
    ids: set[str] = set()

    async def episode(number: int) -> tuple[float, float]:
        task = answer_task(expected=str(number), id=f"answer-{number}")
        async with AsyncSandboxEnv(task, provider=provider) as env:
            obs, info = await env.reset()
            assert str(number) in obs
            ids.add(info["sandbox_id"])
            # even episodes answer right, odd ones wrong; each leaves a process running
            answer = number if number % 2 == 0 else number + 1
            obs, *_ = await env.step(f"sleep 1000 & echo {answer} > answer.txt; cat answer.txt")
            assert f"{answer}" in obs
            _, reward, terminated, _, info = await env.step({"tool": "submit"})
            assert terminated and info["sandbox_id"] in ids
            return float(number % 2 == 0), reward

    results = await asyncio.gather(*(episode(n) for n in range(EPISODES)))
    assert all(expected == got for expected, got in results)
    assert len(ids) == EPISODES
    assert await provider.list() == []
    assert_no_leftovers(ids)
