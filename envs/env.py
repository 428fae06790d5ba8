"""SandboxEnv: a multi-turn environment whose episode lives in one sandbox.

``AsyncSandboxEnv`` is the implementation (so one process can run hundreds of episodes at
once); ``SandboxEnv`` is the ``gymnasium.Env`` that drives it on rollbox's shared loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import secrets
import shlex
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, SupportsFloat, TypeVar

import gymnasium
import numpy as np
from gymnasium.envs.registration import EnvSpec
from gymnasium.utils import seeding

from rollbox.envs.actions import Bash, InvalidAction, ReadFile, Submit, WriteFile, parse_action
from rollbox.envs.task import Task, load_tasks, task_by_id
from rollbox.envs.text import PrintableText, clip, format_exec, sanitize
from rollbox.envs.verify import verify
from rollbox.errors import CommandError, ConfigError, SandboxFileError, TaskSetupError
from rollbox.sandbox.base import AsyncSandbox, Provider, sandbox_path
from rollbox.sandbox.models import ExecResult
from rollbox.sandbox.sync import run_sync

SHELL_ENV_ID = "rollbox/Shell-v0"
DEFAULT_MAX_OUTPUT_CHARS = 10_000
OBSERVATION_MAX_CHARS = 100_000
ACTION_MAX_CHARS = 100_000
# Commands longer than this go through a script file: one argv string is capped at 128 KiB.
_INLINE_COMMAND_BYTES = 64 * 1024
_DONE_TIMEOUT_SECONDS = 30.0
_READ_LIMIT_BYTES = 1_000_000

StepResult = tuple[str, float, bool, bool, dict[str, Any]]
T = TypeVar("T")


_REASONS = {
    "submit": "the agent submitted",
    "done_condition": "the task's done condition holds",
    "max_turns": "max_turns reached",
    "time_budget": "the episode's time budget ran out",
}


@dataclass
class _Episode:
    task: Task
    sandbox: AsyncSandbox | None
    sandbox_id: str
    template_id: str
    started: float = field(default_factory=time.monotonic)
    turn: int = 0
    done: bool = False

    def remaining(self) -> float | None:
        budget = self.task.episode_timeout_seconds
        return None if budget is None else budget - (time.monotonic() - self.started)

    def info(self) -> dict[str, Any]:
        return {
            "task_id": self.task.id,
            "turn": self.turn,
            "sandbox_id": self.sandbox_id,
            "template": self.task.template,
            "template_id": self.template_id,
        }


def _as_task(task: Task | Mapping[str, Any]) -> Task:
    if isinstance(task, Task):
        return task
    if isinstance(task, Mapping):
        return Task(**task)
    raise ConfigError(
        f"a task is a rollbox.envs.Task or a dict of its fields, not {type(task).__name__}"
    )


async def _resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class AsyncSandboxEnv:
    """The async episode core: ``await reset()``, ``await step(action)``, ``await close()``.

    Args:
        task: the task of every episode (or pass one per episode: ``reset(options={"task": t})``).
        tasks: tasks to draw from at each reset (by ``np_random``), or pick by
            ``reset(options={"task_id": ...})``; a JSONL file or task directory path works too.
        provider: a provider name or instance that creates the sandboxes.
        max_output_chars: stdout and stderr are each cut to this many characters per
            observation (head and tail kept, with a mark in between).
    """

    def __init__(
        self,
        task: Task | Mapping[str, Any] | None = None,
        *,
        tasks: Sequence[Task | Mapping[str, Any]] | str | os.PathLike[str] | None = None,
        provider: str | Provider = "local",
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        if not 100 <= max_output_chars <= OBSERVATION_MAX_CHARS // 2 - 1000:
            raise ConfigError(
                f"max_output_chars must be within 100..{OBSERVATION_MAX_CHARS // 2 - 1000}"
            )
        if isinstance(tasks, str | os.PathLike):
            tasks = load_tasks(tasks)
        self.tasks: tuple[Task, ...] = tuple(_as_task(t) for t in tasks or ())
        self.task: Task | None = _as_task(task) if task is not None else None
        self.provider = provider
        self.max_output_chars = max_output_chars
        self.np_random: np.random.Generator | None = None
        self._episode: _Episode | None = None
        self._busy = False
        self._kill: asyncio.Future[None] | None = None

    # -- public API ----------------------------------------------------------------------------

    @property
    def sandbox(self) -> AsyncSandbox | None:
        """The sandbox of the running episode (None between episodes)."""
        return self._episode.sandbox if self._episode is not None else None

    @property
    def episode_task(self) -> Task | None:
        """The task of the current (or last) episode."""
        return self._episode.task if self._episode is not None else None

    async def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """End any running episode (its sandbox is killed) and start a new one.

        ``options`` may hold ``task`` (a Task or dict) or ``task_id`` (one of ``tasks``).
        Returns the instruction and an info dict.

        Raises:
            ConfigError: no task to run, or a bad option.
            SandboxStartError, TooManySandboxesError: no sandbox could be had.
            TaskSetupError: the task's files or setup commands failed.
        """
        if seed is not None:
            self.np_random, _ = seeding.np_random(seed)
        task = self._pick_task(options)
        self._enter()
        try:
            await self._end_episode()
            started = time.monotonic()
            sandbox = await AsyncSandbox.create(
                task.id[:128],
                from_template=task.template,
                network=task.network,
                limits=task.limits,
                env_vars=task.env_vars,
                ttl_seconds=task.sandbox_ttl_seconds,
                provider=self.provider,
            )
            episode = self._episode = _Episode(task, sandbox, sandbox.id, sandbox.template_id)
            setup = await self._prepare(sandbox, task)
            episode.started = time.monotonic()
        except BaseException:
            await asyncio.shield(self._end_episode())
            raise
        finally:
            self._busy = False
        info = episode.info()
        info["max_turns"] = task.max_turns
        info["setup"] = setup
        info["duration_s"] = episode.started - started
        return clip(sanitize(task.instruction), OBSERVATION_MAX_CHARS), info

    async def step(self, action: str | Mapping[str, Any] | Any) -> StepResult:
        """Run one action; returns ``(observation, reward, terminated, truncated, info)``.

        Any exception ends the episode: its sandbox is killed before the exception propagates.

        Raises:
            ConfigError: no episode is running, or ``action`` is neither text nor a tool call.
            SandboxError: the sandbox died (infrastructure, never shown to the agent).
        """
        episode = self._episode
        if episode is None or episode.done:
            raise ConfigError(
                "no episode is running: call reset() first"
                if episode is None
                else "this episode is over: call reset() to start the next one"
            )
        self._enter()
        try:
            return await self._step(episode, action)
        except BaseException:
            await asyncio.shield(self._end_episode())
            raise
        finally:
            self._busy = False

    async def close(self) -> None:
        """End the running episode, if any: its sandbox and everything in it are gone."""
        await self._end_episode()

    async def __aenter__(self) -> AsyncSandboxEnv:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.close())

    # -- episode -------------------------------------------------------------------------------

    def _enter(self) -> None:
        if self._busy:
            raise ConfigError("reset() or step() is already running on this env; await it first")
        self._busy = True

    def _pick_task(self, options: Mapping[str, Any] | None) -> Task:
        options = dict(options or {})
        unknown = sorted(set(options) - {"task", "task_id"})
        if unknown:
            raise ConfigError(f"unknown reset option(s) {unknown}; known: 'task', 'task_id'")
        if options.get("task") is not None:
            task = _as_task(options["task"])
            if not self.tasks:
                self.task = task  # later resets without options run it again
            return task
        if options.get("task_id") is not None:
            pool = self.tasks or ((self.task,) if self.task else ())
            return task_by_id(pool, options["task_id"])
        if self.tasks:
            if self.np_random is None:
                self.np_random, _ = seeding.np_random()
            return self.tasks[int(self.np_random.integers(len(self.tasks)))]
        if self.task is not None:
            return self.task
        raise ConfigError(
            "no task to run: give one to the env (task=...) or to reset(options={'task': ...})"
        )

    async def _prepare(self, sandbox: AsyncSandbox, task: Task) -> list[dict[str, Any]]:
        for path, file in task.files.items():
            try:
                await sandbox.files.write(path, file.content, mode=file.mode)
            except (SandboxFileError, ConfigError) as exc:
                raise TaskSetupError(
                    f"task {task.id!r}: cannot place file {path!r}: {exc}",
                    task_id=task.id,
                    sandbox_id=sandbox.id,
                ) from exc
        log = []
        for command in task.setup:
            try:
                result = await sandbox.commands.run(
                    command, timeout_seconds=task.setup_timeout_seconds
                )
            except CommandError as exc:
                raise TaskSetupError(
                    f"task {task.id!r}: setup command {command!r} could not start: {exc}",
                    task_id=task.id,
                    sandbox_id=sandbox.id,
                ) from exc
            log.append(
                {"command": command, "exit_code": result.exit_code, "duration_s": result.duration_s}
            )
            if not result.ok:
                how = (
                    f"timed out after {task.setup_timeout_seconds:g} s"
                    if result.timed_out
                    else f"exited with {result.exit_code}"
                )
                output = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
                raise TaskSetupError(
                    f"task {task.id!r}: setup command {command!r} {how}\n{output}",
                    task_id=task.id,
                    sandbox_id=sandbox.id,
                    output=output,
                )
        return log

    async def _step(self, episode: _Episode, action: Any) -> StepResult:
        parsed = parse_action(action)
        task = episode.task
        sandbox = episode.sandbox
        assert sandbox is not None
        episode.turn += 1
        started = time.monotonic()
        info = episode.info()
        info.update(tool=parsed.tool, exit_code=None, timed_out=False)
        reason: str | None = None
        remaining = episode.remaining()
        if remaining is not None and remaining <= 0:
            observation = "(not run)"
            reason = "time_budget"
        elif isinstance(parsed, Submit):
            observation = "submitted"
            reason = "submit"
        else:
            timeout = task.step_timeout_seconds
            if remaining is not None:
                timeout = min(timeout, remaining)
            observation = await self._act(sandbox, parsed, timeout, info)
            remaining = episode.remaining()
            if task.done_command is not None and await self._done(sandbox, task, remaining):
                reason = "done_condition"
            elif episode.turn >= task.max_turns:
                reason = "max_turns"
            elif remaining is not None and remaining <= 0:
                reason = "time_budget"
        info["duration_s"] = time.monotonic() - started
        terminated = reason in ("submit", "done_condition")
        truncated = reason in ("max_turns", "time_budget")
        reward = 0.0
        if reason is not None:
            episode.done = True
            verified = time.monotonic()
            result = await verify(sandbox, task)
            reward = result.score
            info["termination"] = reason
            info["reward_components"] = dict(result.components)
            info["verifier"] = dict(result.details)
            info["verifier_duration_s"] = time.monotonic() - verified
            observation += f"\n[episode over: {_REASONS[reason]}]"
            await self._end_episode()
        elif task.shaping is not None:
            reward = float(await _resolve(task.shaping(sandbox, task, info)))
        info["elapsed_s"] = time.monotonic() - episode.started
        # sanitize again: error messages may quote what the agent sent (a path, a tool name)
        observation = clip(sanitize(observation), OBSERVATION_MAX_CHARS)
        return observation, float(reward), terminated, truncated, info

    async def _act(
        self,
        sandbox: AsyncSandbox,
        action: Bash | WriteFile | ReadFile | InvalidAction,
        timeout: float,
        info: dict[str, Any],
    ) -> str:
        """Do one action; the agent's mistakes come back as text, infrastructure errors raise."""
        if isinstance(action, InvalidAction):
            return f"error: {action.reason}"
        if isinstance(action, WriteFile):
            try:
                path = sandbox_path(action.path)
                await sandbox.files.write(path, action.content)
            except (SandboxFileError, ConfigError) as exc:
                return f"error: {exc}"
            return f"wrote {len(action.content.encode()):,} bytes to {path}"
        if isinstance(action, ReadFile):
            return await self._read(sandbox, action.path, timeout)
        if not action.command.strip():
            return "error: empty command"
        result = await self._run(sandbox, action.command, timeout)
        if isinstance(result, str):
            return result
        info.update(exit_code=result.exit_code, timed_out=result.timed_out)
        return format_exec(
            result, max_chars=self.max_output_chars, output_cap=sandbox.spec.limits.output_bytes
        )

    async def _read(self, sandbox: AsyncSandbox, path: str, timeout: float) -> str:
        # Through a bounded command, not files.read: /dev/zero, a FIFO or a file of a gigabyte
        # must cost the agent a turn, not kill the sandbox's agent or the host's memory.
        try:
            path = sandbox_path(path)
        except ConfigError as exc:
            return f"error: {exc}"
        limit = min(_READ_LIMIT_BYTES, sandbox.spec.limits.output_bytes)
        result = await self._run(sandbox, f"head -c {limit} -- {shlex.quote(path)}", timeout)
        if isinstance(result, str):
            return result
        if result.timed_out:
            return f"error: read_file {path} timed out (a pipe or a device?)"
        if result.exit_code != 0:
            return f"error: read_file: {result.stderr.strip().removeprefix('head: ')}"
        content = sanitize(result.stdout)
        if not content:
            return "(empty file)"
        content = clip(content, self.max_output_chars)
        if len(result.stdout.encode(errors="replace")) >= limit:
            content += f"\n[the file goes on past {limit:,} bytes]"
        return content

    async def _run(self, sandbox: AsyncSandbox, command: str, timeout: float) -> ExecResult | str:
        if "\0" in command:
            return "error: the command contains a NUL byte"
        if len(command.encode(errors="replace")) > _INLINE_COMMAND_BYTES:
            script = f"/tmp/.rollbox-command-{secrets.token_hex(6)}.sh"
            try:  # the script removes itself; sh keeps reading it from the open file
                await sandbox.files.write(script, f'rm -f -- "$0"\n{command}\n')
            except SandboxFileError as exc:
                return f"error: the command is too long to pass inline and {exc}"
            command = f"exec /bin/sh {script}"
        try:
            return await sandbox.commands.run(command, timeout_seconds=max(timeout, 0.001))
        except CommandError as exc:
            return f"error: the command could not start: {exc}"

    async def _done(self, sandbox: AsyncSandbox, task: Task, remaining: float | None) -> bool:
        assert task.done_command is not None
        timeout = min(task.step_timeout_seconds, _DONE_TIMEOUT_SECONDS)
        if remaining is not None:
            timeout = min(timeout, max(remaining, 1.0))
        try:
            result = await sandbox.commands.run(task.done_command, timeout_seconds=timeout)
        except CommandError:
            return False
        return result.ok

    async def _end_episode(self) -> None:
        episode = self._episode
        if episode is not None:
            episode.done = True
            sandbox, episode.sandbox = episode.sandbox, None
            if sandbox is not None:
                # a task of its own, so that a later close() can wait for a kill that a
                # cancelled step started (a Ctrl-C in the sync facade)
                self._kill = asyncio.ensure_future(sandbox.kill())
        if self._kill is not None:
            await asyncio.shield(self._kill)


def _default_spec(env_id: str, entry_point: str, kwargs: dict[str, Any]) -> EnvSpec:
    """The spec of an env built without ``gymnasium.make``, as if it had been made by ``env_id``."""
    return EnvSpec(
        id=env_id,
        entry_point=entry_point,
        nondeterministic=True,  # commands take varying time and sandbox ids differ per episode
        kwargs=kwargs,
    )


class SandboxEnv(gymnasium.Env[str, Any]):
    """A ``gymnasium.Env`` whose episode runs in its own sandbox.

    Observations and actions are ``Text`` (printable Unicode, ``min_length=0``); an action may
    also be a tool call dict, or a JSON object with ``"tool"`` as text. See ``AsyncSandboxEnv``
    for the arguments. Registered as ``rollbox/Shell-v0``.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's convention

    def __init__(
        self,
        task: Task | Mapping[str, Any] | None = None,
        *,
        tasks: Sequence[Task | Mapping[str, Any]] | str | os.PathLike[str] | None = None,
        provider: str | Provider = "local",
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        render_mode: str | None = None,
    ) -> None:
        if render_mode is not None:
            raise ConfigError(f"render_mode {render_mode!r} is not supported (none is)")
        self.core = AsyncSandboxEnv(
            task, tasks=tasks, provider=provider, max_output_chars=max_output_chars
        )
        self.observation_space = PrintableText(OBSERVATION_MAX_CHARS)
        self.action_space = PrintableText(ACTION_MAX_CHARS)
        self.render_mode = None
        kwargs: dict[str, Any] = {"max_output_chars": max_output_chars}
        if self.core.task is not None:
            kwargs["task"] = self.core.task
        if self.core.tasks:
            kwargs["tasks"] = self.core.tasks
        if isinstance(provider, str):
            kwargs["provider"] = provider
        self.spec = self._spec(kwargs)

    def _spec(self, kwargs: dict[str, Any]) -> EnvSpec:
        return _default_spec(SHELL_ENV_ID, "rollbox.envs.env:SandboxEnv", kwargs)

    @property
    def sandbox_id(self) -> str | None:
        """The id of the running episode's sandbox (None between episodes)."""
        sandbox = self.core.sandbox
        return sandbox.id if sandbox is not None else None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode in a fresh sandbox; returns ``(instruction, info)``."""
        super().reset(seed=seed)
        self.core.np_random = self.np_random
        return self._run(self.core.reset(options=options))

    def step(self, action: Any) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        """Run one action; returns ``(observation, reward, terminated, truncated, info)``."""
        return self._run(self.core.step(action))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return run_sync(coro)
        except (KeyboardInterrupt, SystemExit):
            # run_sync cancelled the call; wait until the sandbox it was using is dead, or the
            # interpreter may exit while the loop thread is still tearing it down
            with contextlib.suppress(Exception):
                run_sync(self.core.close())
            raise

    def close(self) -> None:
        """Kill the running episode's sandbox, if any."""
        if self.core.sandbox is not None:  # no loop round trip otherwise (e.g. at exit)
            run_sync(self.core.close())
        super().close()
