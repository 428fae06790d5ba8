"""Score two candidate programs for ``add(a, b)``, each in its own sandbox, in parallel.

python examples/score_candidates.py      # prints [1.0, 0.0]
"""

from __future__ import annotations

import asyncio

from rollbox.envs import AsyncSandboxEnv, Task

CANDIDATES = [
    "def add(a, b):\n    return a + b\n",
    "def add(a, b):\n    return a - b\n",
]

TASK = Task(
    id="add",
    instruction="Write a function add(a, b) that returns the sum of a and b in /work/solution.py.",
    verifier={
        "command": 'python3 "$TESTS_DIR/test_add.py"',
        "files": {
            "test_add.py": (
                "import sys\n"
                "sys.path.insert(0, '/work')\n"
                "from solution import add\n"
                "assert add(2, 3) == 5\n"
                "assert add(-1, 1) == 0\n"
                "assert add(0.5, 0.25) == 0.75\n"
            )
        },
    },
    max_turns=2,
)


async def score(program: str) -> float:
    """Write ``program`` as the solution, submit, and return the reward."""
    async with AsyncSandboxEnv(TASK) as env:
        await env.reset()
        await env.step({"tool": "write_file", "path": "solution.py", "content": program})
        _, reward, terminated, _, _ = await env.step({"tool": "submit"})
        assert terminated
        return reward


async def main() -> None:
    rewards = await asyncio.gather(*(score(program) for program in CANDIDATES))
    print(list(rewards))


if __name__ == "__main__":
    asyncio.run(main())
