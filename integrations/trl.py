"""TRL: sandbox rewards for ``GRPOTrainer(reward_funcs=...)`` and a tool environment for
``GRPOTrainer(environment_factory=...)``.

Needs ``pip install 'rollbox[trl]'`` (install torch for your platform first).

- ``sandbox_reward(reward)`` scores every completion of a batch in its own sandbox, at most
  ``n_concurrent`` at once, and returns one float per completion, or ``None`` where the sandbox
  failed (TRL then leaves the sample out; the error is logged). ``sandbox_reward()`` with no
  reward scores HumanEval-layout rows (``prompt``, ``test``, ``entry_point``).
- ``SandboxToolEnv`` gives the model ``bash``, ``write_file`` and ``read_file`` in a fresh
  sandbox per rollout, and scores the sandbox with the task's verifier in ``get_reward``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from rollbox.errors import BackendUnavailableError, ConfigError

try:
    import trl  # noqa: F401 - fail here, with the fix, rather than inside the trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the TRL integration needs trl ({exc}): install torch for your platform first, then "
        "pip install 'rollbox[trl]'"
    ) from exc

from rollbox.envs.env import AsyncSandboxEnv
from rollbox.envs.task import Task
from rollbox.rewards import (
    INFRASTRUCTURE_ERRORS,
    PythonTests,
    Reward,
    RewardResult,
    code_prompt,
    completion_text,
    extract_code,
    humaneval_program,
    humaneval_tests,
    score_programs,
)
from rollbox.rewards.function_tests import SOLUTION_PATH
from rollbox.rewards.scoring import DEFAULT_LIMITS
from rollbox.sandbox.base import Provider
from rollbox.sandbox.models import Limits
from rollbox.sandbox.sync import run_sync, shared_loop

__all__ = ["AsyncSandboxReward", "SandboxReward", "SandboxToolEnv", "sandbox_reward"]

log = logging.getLogger("rollbox.integrations.trl")

# What TRL passes to reward functions besides the dataset's columns.
_TRAINER_ARGUMENTS = frozenset(
    {"trainer_state", "log_extra", "log_metric", "environments", "completion_ids"}
)
ProgramBuilder = Callable[[str, Mapping[str, Any]], str]


def default_program(text: str, row: Mapping[str, Any]) -> str:
    """The program a completion makes: HumanEval assembly when the row has an ``entry_point``
    (the completion continues the prompt, or is a whole function), else the last code block."""
    entry_point = row.get("entry_point")
    if isinstance(entry_point, str) and entry_point.isidentifier():
        return humaneval_program(code_prompt(row), text, entry_point)
    return extract_code(text)


class SandboxReward:
    """A TRL reward function, ``(prompts, completions, **kwargs) -> list[float | None]``.

    Build it with ``sandbox_reward``. ``last_results`` holds the batch's ``RewardResult`` s
    (``None`` where the sandbox failed), with each sandbox's id in ``details["sandbox_id"]``.
    """

    def __init__(
        self,
        reward: Reward,
        *,
        n_concurrent: int,
        provider: str | Provider,
        template: str,
        limits: Limits,
        solution_path: str,
        program: ProgramBuilder,
        name: str,
    ) -> None:
        self.reward = reward
        self.n_concurrent = n_concurrent
        self.options: dict[str, Any] = {
            "provider": provider,
            "template": template,
            "limits": limits,
            "solution_path": solution_path,
        }
        self.program = program
        self.__name__ = name  # TRL logs this reward as rewards/<name>/mean
        self.last_results: list[RewardResult | None] = []

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        return run_sync(self.score_batch(prompts, completions, **kwargs))

    async def score_batch(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        """Score a batch (on any event loop); what ``__call__`` runs."""
        if len(prompts) != len(completions):
            raise ConfigError(f"{len(prompts)} prompts but {len(completions)} completions")
        rows = _rows(prompts, len(completions), kwargs)
        texts = [completion_text(completion) for completion in completions]
        programs = [self.program(text, row) for text, row in zip(texts, rows, strict=True)]
        started = time.monotonic()
        results = await score_programs(
            programs,
            self.reward,
            completions=texts,
            rows=rows,
            n_concurrent=self.n_concurrent,
            **self.options,
        )
        self.last_results = results
        self._log(results, time.monotonic() - started, kwargs)
        return [None if result is None else result.score for result in results]

    def _log(
        self, results: list[RewardResult | None], seconds: float, kwargs: Mapping[str, Any]
    ) -> None:
        prefix = f"rollbox/{self.reward.name}"
        log_metric, log_extra = kwargs.get("log_metric"), kwargs.get("log_extra")
        scored = [result for result in results if result is not None]
        if callable(log_metric):
            log_metric(f"{prefix}/sandbox_failures", float(len(results) - len(scored)))
            log_metric(f"{prefix}/batch_seconds", seconds)
            components = {key for result in scored for key in result.components}
            for component in sorted(components - {self.reward.name}):  # TRL logs the score
                values = [r.components[component] for r in scored if component in r.components]
                log_metric(f"{prefix}/{component}", sum(values) / len(values))
        if callable(log_extra):
            log_extra(
                f"{self.__name__}_sandbox",
                [None if r is None else r.details.get("sandbox_id") for r in results],
            )
            log_extra(f"{self.__name__}_result", [_summary(r) for r in results])


class AsyncSandboxReward(SandboxReward):
    """The async form: TRL awaits it alongside its other async reward functions."""

    async def __call__(  # type: ignore[override]
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        # Sandboxes live on rollbox's loop, whichever loop awaits us (TRL runs its own).
        future = asyncio.run_coroutine_threadsafe(
            self.score_batch(prompts, completions, **kwargs), shared_loop()
        )
        return await asyncio.wrap_future(future)


def sandbox_reward(
    reward: Reward | None = None,
    *,
    n_concurrent: int | None = None,
    provider: str | Provider = "local",
    template: str = "python",
    limits: Limits | None = None,
    solution_path: str = SOLUTION_PATH,
    program: ProgramBuilder | None = None,
    asynchronous: bool = False,
    name: str | None = None,
) -> SandboxReward:
    """A reward function for ``GRPOTrainer(reward_funcs=[...])`` that runs code in sandboxes.

    Each completion (text, or chat messages whose assistant turns are joined) becomes a program
    (``program(text, row)``; by default its last Python code block, or HumanEval assembly when
    the row has an ``entry_point``), which is written to ``solution_path`` in a fresh sandbox and
    scored by ``reward``. The row is the dataset's columns (TRL passes them as keyword
    arguments) plus ``prompt``, so ``Column("test")`` reads each row's tests.

    Args:
        reward: what to score with; default ``humaneval_tests()``: the HumanEval layout
            (``prompt``, ``test``, ``entry_point``), the completion either continuing the prompt
            or being a whole function in a code block.
        n_concurrent: sandboxes at once (default: twice the CPU count).
        provider, template, limits: where and how the sandboxes run.
        asynchronous: return the async form (TRL runs async reward functions concurrently).
        name: what TRL logs the reward as (default ``rollbox_<reward name>``).

    Returns one float per completion, or ``None`` where the sandbox could not start or died
    (TRL leaves that sample out; the error is logged). Figures go to TRL's ``log_metric``
    (``rollbox/<name>/...``: mean of each component, sandbox failures, batch time) and
    ``log_extra`` (each sample's sandbox id and result) when the trainer passes them.
    """
    if reward is not None and not isinstance(reward, Reward):
        raise ConfigError(f"sandbox_reward: {reward!r} is not a rollbox reward (rollbox.rewards)")
    if n_concurrent is not None and (not isinstance(n_concurrent, int) or n_concurrent < 1):
        raise ConfigError(
            f"sandbox_reward: n_concurrent must be a positive int, not {n_concurrent!r}"
        )
    reward = reward if reward is not None else humaneval_tests()
    cls = AsyncSandboxReward if asynchronous else SandboxReward
    return cls(
        reward,
        n_concurrent=n_concurrent or 2 * (os.cpu_count() or 1),
        provider=provider,
        template=template,
        limits=limits or DEFAULT_LIMITS,
        solution_path=solution_path,
        program=program or default_program,
        name=name or f"rollbox_{reward.name}",
    )


def _rows(prompts: Sequence[Any], count: int, kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    columns = {
        key: value
        for key, value in kwargs.items()
        if key not in _TRAINER_ARGUMENTS and isinstance(value, list | tuple) and len(value) == count
    }
    return [
        {**{key: value[i] for key, value in columns.items()}, "prompt": prompts[i]}
        for i in range(count)
    ]


def _summary(result: RewardResult | None) -> str:
    if result is None:
        return "sandbox failed: no reward"
    if result.error:
        return f"{result.score:.2f}: {result.error[:120]}"
    fraction = result.details.get("fraction")
    passed = result.details.get("passed")
    if isinstance(fraction, float) and isinstance(passed, list):
        failed = result.details.get("failed") or []
        return f"{result.score:.2f}: {len(passed)}/{len(passed) + len(failed)} tests passed"
    return f"{result.score:.2f}"


# -- environment_factory ----------------------------------------------------------------------

_HUMANEVAL_INSTRUCTION = """\
Complete the Python function `{entry_point}` in {path}, which holds its signature and \
docstring. Use the tools: bash runs a shell command in /work (python3, no network), \
write_file and read_file write and read files. Hidden tests will call `{entry_point}` once you \
stop calling tools."""

_GONE = "(the sandbox is gone; this episode will not be scored)"
_LIVE: weakref.WeakSet[SandboxToolEnv] = weakref.WeakSet()


def task_from_row(row: Mapping[str, Any]) -> Task:
    """The task of a dataset row: its ``task`` column (a Task, its fields as a dict, or JSON
    text of them), or a HumanEval-layout row (``test``, ``entry_point``, and the prompt).

    Raises:
        ConfigError: neither is there, or the task is invalid.
    """
    task = row.get("task")
    if task is not None:
        if isinstance(task, Task):
            return task
        if isinstance(task, str):
            try:
                task = json.loads(task)
            except ValueError as exc:
                raise ConfigError(f"the row's task column is not JSON of a task: {exc}") from exc
        if isinstance(task, Mapping):
            return Task(**task)
        raise ConfigError(
            f"the row's task column is a Task, a dict or JSON text, not {type(task).__name__}"
        )
    if "test" in row and "entry_point" in row:
        prompt = code_prompt(row)
        entry_point = row["entry_point"]
        if prompt is None or not isinstance(entry_point, str):
            raise ConfigError(
                "a HumanEval row needs the function's prompt as its prompt (text, or the last "
                "user message of a chat) and entry_point as a name"
            )
        return Task(
            id=str(row.get("task_id") or entry_point),
            instruction=_HUMANEVAL_INSTRUCTION.format(entry_point=entry_point, path=SOLUTION_PATH),
            files={SOLUTION_PATH: prompt},
            limits=Limits(memory_mb=512, pids=128),
            max_turns=20,
            step_timeout_seconds=30.0,
            episode_timeout_seconds=900.0,
            verifier=PythonTests(
                tests=row["test"], entry_point=entry_point, context=prompt, name="humaneval"
            ),
            metadata={"entry_point": entry_point},
        )
    known = ", ".join(sorted(str(key) for key in row)) or "none"
    raise ConfigError(
        "SandboxToolEnv.reset: the row has neither a 'task' column (a rollbox Task, its fields "
        f"as a dict, or JSON) nor the HumanEval columns 'test' and 'entry_point'; it has: {known}"
    )


class SandboxToolEnv:
    """A TRL ``environment_factory``: each rollout works in a fresh sandbox through tools.

    ``GRPOTrainer(environment_factory=SandboxToolEnv, ...)``. TRL calls ``reset(**row)`` before
    each rollout: the previous sandbox is killed and a new one starts for the row's task (see
    ``task_from_row``); the task's instruction is appended to the prompt. The model calls
    ``bash``, ``write_file`` and ``read_file``; ``get_reward`` runs the task's verifier once the
    rollout ends (or takes the reward of an episode that already ended at ``max_turns``), then
    kills the sandbox. A sandbox that fails gives ``None``: TRL leaves the rollout out.

    Subclass to change ``provider`` or ``max_output_chars``. ``trace`` records the episode's
    events (reset, tool calls, reward) with the sandbox id; ``close_all()`` kills every
    environment's sandbox (the provider also kills them at exit).
    """

    provider: ClassVar[str | Provider] = "local"
    max_output_chars: ClassVar[int] = 4000

    def __init__(self) -> None:
        self._core = AsyncSandboxEnv(provider=self.provider, max_output_chars=self.max_output_chars)
        self.task: Task | None = None
        self.sandbox_id: str | None = None
        self.result: dict[str, Any] = {}
        self.trace: list[dict[str, Any]] = []
        self._reward: float | None = None
        self._over = False
        self._failed = False
        _LIVE.add(self)

    def reset(self, **row: Any) -> str | None:
        """Start the row's task in a fresh sandbox; its instruction goes after the prompt."""
        task = task_from_row(row)
        self.task, self.sandbox_id, self.result, self.trace = task, None, {}, []
        self._reward, self._over, self._failed = None, False, False
        try:
            instruction, info = run_sync(self._core.reset(options={"task": task}))
        except INFRASTRUCTURE_ERRORS as exc:
            self._fail("reset", exc)
            return None
        self.sandbox_id = info["sandbox_id"]
        self.trace.append({"event": "reset", "task_id": task.id, "sandbox_id": self.sandbox_id})
        return "\n\n" + instruction  # TRL appends this to the last user message as it is

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox and return its exit code, stdout and stderr.

        Args:
            command: The command to run with /bin/sh, in /work.

        Returns:
            The exit code and the output of the command.
        """
        return self._act({"tool": "bash", "command": command})

    def write_file(self, path: str, content: str) -> str:
        """Write a text file in the sandbox.

        Args:
            path: Where to write; relative paths are under /work.
            content: The whole text of the file.

        Returns:
            What was written, or the error.
        """
        return self._act({"tool": "write_file", "path": path, "content": content})

    def read_file(self, path: str) -> str:
        """Read a text file in the sandbox.

        Args:
            path: The file to read; relative paths are under /work.

        Returns:
            The text of the file, or the error.
        """
        return self._act({"tool": "read_file", "path": path})

    def get_reward(self) -> float | None:
        """Score the sandbox with the task's verifier (once), then kill the sandbox."""
        if self._failed or self.task is None:
            return None
        if not self._over:
            try:
                _, reward, *_, info = run_sync(self._core.step({"tool": "submit"}))
            except INFRASTRUCTURE_ERRORS as exc:
                self._fail("get_reward", exc)
                return None
            self._finish(reward, info)
        self.trace.append(
            {"event": "reward", "reward": self._reward, "sandbox_id": self.sandbox_id}
        )
        return self._reward

    def close(self) -> None:
        """Kill this environment's sandbox, if one is alive."""
        if self._core.sandbox is not None:
            run_sync(self._core.close())

    @classmethod
    def close_all(cls) -> None:
        """Kill the sandbox of every live environment of this class."""
        for env in list(_LIVE):
            if isinstance(env, cls):
                env.close()

    def _act(self, action: dict[str, Any]) -> str:
        if self._failed:
            return _GONE
        if self._over or self._core.sandbox is None:
            return "the episode is over: nothing more runs"
        try:
            observation, reward, terminated, truncated, info = run_sync(self._core.step(action))
        except INFRASTRUCTURE_ERRORS as exc:
            self._fail(action["tool"], exc)
            return _GONE
        self.trace.append(
            {
                "event": action["tool"],
                "sandbox_id": self.sandbox_id,
                "exit_code": info.get("exit_code"),
            }
        )
        if terminated or truncated:  # max_turns or the task's done condition: already scored
            self._finish(reward, info)
        return observation

    def _finish(self, reward: float, info: Mapping[str, Any]) -> None:
        self._over = True
        self._reward = float(reward)
        self.result = {
            "reward": self._reward,
            "components": info.get("reward_components", {}),
            "details": info.get("verifier", {}),
            "termination": info.get("termination"),
        }

    def _fail(self, where: str, exc: BaseException) -> None:
        self._failed = True
        self.trace.append({"event": "sandbox_failed", "where": where, "error": str(exc)})
        log.error(
            "SandboxToolEnv: no reward for task %r, the sandbox failed in %s: %s: %s",
            self.task.id if self.task else None,
            where,
            type(exc).__name__,
            exc,
        )
