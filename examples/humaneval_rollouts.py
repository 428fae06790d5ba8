"""A Dataset and an Agent for ``rollbox run``: HumanEval, solved by a stand-in agent.

    rollbox run --dataset examples.humaneval_rollouts:dataset \\
                --agent examples.humaneval_rollouts:agent --out runs/humaneval
    rollbox report runs/humaneval

The dataset is the 164 HumanEval problems as rollbox Tasks (``rollbox.envs.humaneval``): setup
places the prompt in ``/work/solution.py``; scoring writes the agent's patch (the whole file)
into a fresh sandbox and runs the hidden tests there. The agent writes the canonical solution,
checks that it parses, and submits: replace its ``solve`` with your model's loop (``model`` is
what ``--model`` says).
"""

from __future__ import annotations

import os
from typing import Any

from rollbox.envs import Task, humaneval_tasks
from rollbox.envs.humaneval import SOLUTION_PATH
from rollbox.envs.verify import run_tests
from rollbox.runner import AgentResult
from rollbox.sandbox import AsyncSandbox, SandboxSpec


class HumanEvalDataset:
    """HumanEval as a ``rollbox.runner.Dataset`` (``limit``: the first N problems only)."""

    def __init__(self, limit: int | None = None) -> None:
        self.tasks = humaneval_tasks()[:limit]

    def instances(self) -> list[Task]:
        return self.tasks

    def instance_id(self, task: Task) -> str:
        return task.id

    def template(self, task: Task) -> SandboxSpec:
        return SandboxSpec(
            template=task.template, limits=task.limits, ttl_seconds=task.sandbox_ttl_seconds
        )

    async def setup(self, sandbox: AsyncSandbox, task: Task) -> bool:
        for path, file in task.files.items():
            await sandbox.files.write(path, file.content, mode=file.mode)
        return True

    async def score(self, sandbox: AsyncSandbox, task: Task, patch: str) -> dict[str, Any]:
        await sandbox.files.write(SOLUTION_PATH, patch)
        assert task.verifier is not None and not callable(task.verifier)
        result = await run_tests(sandbox, task.verifier)
        return {"score": result.score, **result.details}


class CanonicalAgent:
    """Stands in for a model: writes the canonical solution and submits it."""

    async def solve(self, sandbox: AsyncSandbox, task: Task, *, model: str | None) -> AgentResult:
        source = task.metadata["prompt"] + task.metadata["canonical_solution"]
        await sandbox.files.write(SOLUTION_PATH, source)
        parsed = await sandbox.commands.run(
            f"python3 -c 'import ast; ast.parse(open(\"{SOLUTION_PATH}\").read())'"
        )
        return AgentResult(patch=source, exit="submitted" if parsed.ok else "syntax_error")


limit = os.environ.get("ROLLBOX_EXAMPLE_LIMIT")
dataset = HumanEvalDataset(int(limit) if limit else None)
agent = CanonicalAgent()
