"""Tasks and multi-turn sandbox environments (imported as ``rollbox.envs``).

Importing this package registers the gymnasium ids ``rollbox/Shell-v0`` (a task passed as
``task=`` or in ``reset(options={"task": ...})``) and ``rollbox/HumanEval-v0``.
"""

import gymnasium

from rollbox.envs.actions import Bash, InvalidAction, ReadFile, Submit, WriteFile, parse_action
from rollbox.envs.env import (
    ACTION_MAX_CHARS,
    OBSERVATION_MAX_CHARS,
    SHELL_ENV_ID,
    AsyncSandboxEnv,
    SandboxEnv,
    TaskSetupError,
)
from rollbox.envs.humaneval import HUMANEVAL_ENV_ID, HumanEvalEnv, humaneval_task, humaneval_tasks
from rollbox.envs.task import Task, TaskFile, TestsVerifier, load_tasks
from rollbox.envs.text import PrintableText

for _id, _entry_point in (
    (SHELL_ENV_ID, "rollbox.envs.env:SandboxEnv"),
    (HUMANEVAL_ENV_ID, "rollbox.envs.humaneval:HumanEvalEnv"),
):
    if _id not in gymnasium.registry:
        # nondeterministic: command timings and sandbox ids differ between runs of one seed
        gymnasium.register(id=_id, entry_point=_entry_point, nondeterministic=True)

__all__ = [
    "ACTION_MAX_CHARS",
    "HUMANEVAL_ENV_ID",
    "OBSERVATION_MAX_CHARS",
    "SHELL_ENV_ID",
    "AsyncSandboxEnv",
    "Bash",
    "HumanEvalEnv",
    "InvalidAction",
    "PrintableText",
    "ReadFile",
    "SandboxEnv",
    "Submit",
    "Task",
    "TaskFile",
    "TaskSetupError",
    "TestsVerifier",
    "WriteFile",
    "humaneval_task",
    "humaneval_tasks",
    "load_tasks",
    "parse_action",
]
