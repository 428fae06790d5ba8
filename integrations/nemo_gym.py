"""NeMo Gym integration: a resources server whose sessions are rollbox sandboxes, and rollbox's
backends as a NeMo Gym sandbox provider.

Needs ``pip install 'rollbox[nemo-gym]'`` (NeMo Gym declares Python >= 3.13).

``RollboxResourcesServer``: each dataset row carries a rollbox task (``Task`` fields, as JSON)
under ``task``. ``/seed_session`` starts the task's episode in a fresh sandbox; the tools
``/run_command``, ``/write_file`` and ``/read_file`` act in that session's sandbox; ``/verify``
runs the task's verifier and returns the reward with its components; ``/close_session`` kills
the sandbox. Both of NeMo Gym's session protocols work: an agent's ``/run`` (the session is the
cookie NeMo Gym's session middleware sets) and an Environment Server's typed
``resources_session_id``. Seeding and closing are idempotent; a session left idle for
``session_idle_timeout_seconds`` expires and its sandbox is killed. A sandbox that cannot start
or dies is an HTTP error (503), never a reward of 0.

``RollboxSandboxProvider``: NeMo Gym's own sandbox API (``nemo_gym.sandbox.AsyncSandbox``) on
rollbox, registered as ``rollbox`` in the ``nemo_gym.sandbox_providers`` entry point group::

    sandbox:
      rollbox:
        backend: local

``python -m rollbox.integrations.nemo_gym serve CONFIG`` starts the resources server a NeMo Gym
config defines (as ``ng_run`` would, without the other servers); ``... dataset TASKS`` turns
rollbox tasks into NeMo Gym JSONL rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shlex
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from rollbox.envs.actions import Bash, ReadFile, Submit, WriteFile
from rollbox.envs.env import (
    DEFAULT_MAX_OUTPUT_CHARS,
    OBSERVATION_MAX_CHARS,
    AsyncSandboxEnv,
    TaskSetupError,
)
from rollbox.envs.task import Task, TestsVerifier, load_tasks
from rollbox.errors import (
    BackendUnavailableError,
    ConfigError,
    RollboxError,
    SandboxDeadError,
    SandboxError,
    SandboxStartError,
    TooManySandboxesError,
)
from rollbox.sandbox.base import AsyncSandbox, Provider, sandbox_path
from rollbox.sandbox.models import Limits, NetworkConfig
from rollbox.sandbox.registry import get_provider, provider_class
from rollbox.sandbox.sync import shared_loop

try:
    from fastapi import FastAPI, HTTPException, Request
    from nemo_gym import failure_kinds
    from nemo_gym.base_resources_server import (
        BaseMultiRewardVerifyResponse,
        BaseResourcesServerConfig,
        BaseSeedSessionRequest,
        BaseSeedSessionResponse,
        BaseVerifyRequest,
        ResourcesCloseSessionRequest,
        ResourcesCloseSessionResponse,
        ResourcesSeedSessionRequest,
        ResourcesSeedSessionResponse,
        SimpleResourcesServer,
    )
    from nemo_gym.sandbox.providers.base import (
        SandboxCreateError,
        SandboxExecResult,
        SandboxHandle,
        SandboxResources,
        SandboxSpec,
        SandboxStatus,
    )
    from nemo_gym.server_utils import SESSION_ID_KEY
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the NeMo Gym integration needs NeMo Gym ({exc}): pip install 'rollbox[nemo-gym]' "
        "(NeMo Gym needs Python >= 3.13)"
    ) from exc

__all__ = [
    "TOOLS",
    "ReadFileRequest",
    "RollboxResourcesServer",
    "RollboxResourcesServerConfig",
    "RollboxSandboxProvider",
    "RollboxVerifyResponse",
    "RunCommandRequest",
    "ToolOutput",
    "WriteFileRequest",
    "dataset_row",
    "main",
    "serve",
    "server_environment",
    "write_dataset",
]

# What NeMo Gym's providers return as the exit code of a command the runtime could not run.
SANDBOX_RUNTIME_RETURN_CODE = 125
T = TypeVar("T")
# Ids of ended sessions are kept (so a late seed cannot revive one) up to this many.
_ENDED_SESSIONS_KEPT = 100_000


# -- the resources server: wire models -------------------------------------------------------


class _ToolRequest(BaseModel):
    # the model writes these arguments: a stray one gets a clear 422 back, not silence
    model_config = ConfigDict(extra="forbid")


class RunCommandRequest(_ToolRequest):
    command: str = Field(description="A shell command, run with /bin/sh -c in /work.")


class WriteFileRequest(_ToolRequest):
    path: str = Field(description="Where to write; relative paths are under /work.")
    content: str = Field(description="The whole text of the file.")


class ReadFileRequest(_ToolRequest):
    path: str = Field(description="The file to read; relative paths are under /work.")


class ToolOutput(BaseModel):
    """What a tool call returns to the model."""

    output: str
    exit_code: int | None = None
    timed_out: bool = False
    done: bool = Field(False, description="the episode is over: further tool calls are refused")


_TOOL_DESCRIPTIONS = {
    "run_command": (
        RunCommandRequest,
        "Run a shell command in your sandbox (cwd /work) and get its exit code, stdout and stderr.",
    ),
    "write_file": (WriteFileRequest, "Write a text file in your sandbox."),
    "read_file": (ReadFileRequest, "Read a text file in your sandbox."),
}


def _function_tool(name: str, model: type[BaseModel], description: str) -> dict[str, Any]:
    properties = {
        field_name: {"type": "string", "description": info.description or ""}
        for field_name, info in model.model_fields.items()
    }
    return {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        },
        "strict": True,
    }


TOOLS: list[dict[str, Any]] = [
    _function_tool(name, model, description)
    for name, (model, description) in _TOOL_DESCRIPTIONS.items()
]
"""The tools of ``RollboxResourcesServer``, as Responses API function tools for a dataset row."""


class RollboxSeedSessionRequest(BaseSeedSessionRequest):
    """An agent's ``/run`` seed: the whole dataset row, whose ``task`` is a rollbox task."""

    model_config = ConfigDict(extra="allow")

    task: dict[str, Any]


class RollboxSeedSessionResponse(BaseSeedSessionResponse):
    task_id: str
    sandbox_id: str


class CloseCookieSessionRequest(BaseModel):
    """Close the session of the request's cookie (an agent's ``/run`` has no session id)."""

    model_config = ConfigDict(extra="forbid")


class RollboxVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")


class RollboxVerifyResponse(BaseMultiRewardVerifyResponse):
    """The reward, its components (``{"tests": 1.0}``), and what the verifier saw."""

    model_config = ConfigDict(extra="allow")

    task_id: str
    termination: str = Field(description="why the episode ended: submit, max_turns, ...")
    turns: int = Field(description="tool calls the episode took")
    verifier_details: dict[str, Any] = Field(
        default_factory=dict, description="exit code and output tails of the verifier, for people"
    )


class RollboxResourcesServerConfig(BaseResourcesServerConfig):
    provider: str = Field("local", description="the rollbox backend that runs the sandboxes")
    session_idle_timeout_seconds: float = Field(
        600.0, gt=0, description="a session unused this long expires and its sandbox is killed"
    )
    max_output_chars: int = Field(
        DEFAULT_MAX_OUTPUT_CHARS,
        ge=100,
        le=OBSERVATION_MAX_CHARS // 2 - 1000,
        description="stdout and stderr are each cut to this per call",
    )


# -- the resources server: sessions ----------------------------------------------------------


@dataclass(eq=False)
class _Outcome:
    reward: float
    components: dict[str, float]
    details: dict[str, Any]
    termination: str
    turns: int


@dataclass(eq=False)
class _Session:
    key: str
    identity: str  # what a repeated seed must match
    task: Task
    env: AsyncSandboxEnv
    started: asyncio.Future[Any]
    episode: Any = None  # the typed protocol's episode_id, which a close must name
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0
    turns: int = 0
    outcome: _Outcome | None = None
    failure: HTTPException | None = None  # the sandbox broke: the episode has no valid reward

    @property
    def sandbox_id(self) -> str:
        sandbox = self.env.sandbox
        return sandbox.id if sandbox is not None else ""


class _Sessions:
    """Every session of one server. It lives on rollbox's shared event loop: sandboxes are bound
    to the loop that made them, and a session outlives the loop of any one request."""

    def __init__(self, config: RollboxResourcesServerConfig) -> None:
        self.config = config
        self.live: dict[str, _Session] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # key -> "closed" or "expired"
        self.reaper: asyncio.Task[None] | None = None

    async def seed(
        self, key: str, identity: str, task_data: dict[str, Any], *, episode: Any = None
    ) -> _Session:
        ended = self.ended.get(key)
        if ended is not None:
            raise HTTPException(409, f"session {key!r} is {ended}; seed a new session")
        session = self.live.get(key)
        if session is None:
            try:
                task = Task(**task_data)
            except ConfigError as exc:
                raise HTTPException(422, f"task: {exc}") from exc
            env = AsyncSandboxEnv(
                task, provider=self.config.provider, max_output_chars=self.config.max_output_chars
            )
            started = asyncio.ensure_future(env.reset())
            session = self.live[key] = _Session(key, identity, task, env, started, episode)
            if self.reaper is None or self.reaper.done():
                self.reaper = asyncio.ensure_future(self._expire_idle())
        elif session.identity != identity:
            raise HTTPException(409, f"session {key!r} was seeded with another task or episode")
        try:
            await asyncio.shield(session.started)
        except Exception as exc:
            if self.live.get(key) is session:
                del self.live[key]  # nothing started: the caller may seed again
            raise _seed_error(exc) from exc
        if self.live.get(key) is not session:
            raise HTTPException(409, f"session {key!r} was closed while it started")
        session.last_used = time.monotonic()
        return session

    async def step(self, key: str, action: Bash | WriteFile | ReadFile) -> ToolOutput:
        session = await self._get(key)
        async with self._using(session):
            if session.failure is not None:
                raise session.failure
            if session.outcome is not None:
                raise HTTPException(
                    409, f"the episode is over ({session.outcome.termination}): nothing more runs"
                )
            try:
                observation, reward, terminated, truncated, info = await session.env.step(action)
            except SandboxError as exc:
                session.failure = _sandbox_failure(exc)
                raise session.failure from exc
            session.turns += 1
            if terminated or truncated:  # max_turns, the time budget or done_command ended it
                session.outcome = _outcome(reward, info, session.turns)
            return ToolOutput(
                output=observation,
                exit_code=info.get("exit_code"),
                timed_out=bool(info.get("timed_out")),
                done=terminated or truncated,
            )

    async def verify(self, key: str) -> tuple[_Session, _Outcome]:
        session = await self._get(key)
        async with self._using(session):
            if session.failure is None and session.outcome is None:
                try:
                    _, reward, _, _, info = await session.env.step(Submit())
                except SandboxError as exc:
                    session.failure = _sandbox_failure(exc)
                else:
                    session.outcome = _outcome(reward, info, session.turns)
            if session.failure is not None:
                raise session.failure
            assert session.outcome is not None
            return session, session.outcome

    def check_close(self, key: str, episode: Any) -> None:
        session = self.live.get(key)
        if session is not None and session.episode != episode:
            raise HTTPException(409, "episode_id does not match the seeded session")

    async def end(self, key: str, why: str) -> None:
        """Kill the session's sandbox and remember that it ended; ending twice is a no-op."""
        self.ended[key] = self.ended.get(key, why)
        self.ended.move_to_end(key)
        while len(self.ended) > _ENDED_SESSIONS_KEPT:
            self.ended.popitem(last=False)
        session = self.live.pop(key, None)
        if session is None:
            return
        with contextlib.suppress(Exception):  # a failed start has nothing to kill
            await asyncio.shield(session.started)
        try:
            await session.env.close()
        except BaseException:
            self.live[key] = session  # still alive: the caller may retry the close
            self.ended.pop(key, None)
            raise

    async def end_all(self) -> None:
        if self.reaper is not None:
            self.reaper.cancel()
        await asyncio.gather(*(self.end(key, "closed") for key in list(self.live)))

    async def _get(self, key: str | None) -> _Session:
        session = self.live.get(key) if key is not None else None
        if session is None:
            ended = self.ended.get(key) if key is not None else None
            if ended is None:
                raise HTTPException(404, "no session: call /seed_session first")
            kind = (
                failure_kinds.SESSION_EXPIRED if ended == "expired" else failure_kinds.SESSION_LOST
            )
            reason = f"this session is {ended}"
            if ended == "expired":
                reason += f" (unused for {self.config.session_idle_timeout_seconds:g} s)"
            raise HTTPException(410, detail={"failure_kind": kind, "failure_reason": reason})
        try:
            await asyncio.shield(session.started)
        except Exception as exc:
            raise _seed_error(exc) from exc
        return session

    @contextlib.asynccontextmanager
    async def _using(self, session: _Session) -> AsyncIterator[None]:
        session.busy += 1  # a session in use never expires, however long its command runs
        try:
            async with session.lock:
                yield
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()

    async def _expire_idle(self) -> None:
        timeout = self.config.session_idle_timeout_seconds
        while self.live:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 30.0))
            now = time.monotonic()
            for key, session in list(self.live.items()):
                if (
                    not session.busy
                    and session.started.done()
                    and now - session.last_used > timeout
                ):
                    with contextlib.suppress(Exception):
                        await self.end(key, "expired")


async def _on_rollbox_loop(coro: Coroutine[Any, Any, T], *, shielded: bool = True) -> T:
    """Run ``coro`` on rollbox's shared loop and wait for it.

    Shielded, cancelling the caller (a client that hung up) lets it finish there, so that a
    half-done step cannot wreck a session; else the cancellation reaches it.
    """
    future = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, shared_loop()))
    return await (asyncio.shield(future) if shielded else future)


def _rollbox_loop_method(method: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Any]:
    """A provider method that runs on rollbox's shared loop, whichever loop awaits it."""

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        return await _on_rollbox_loop(method(*args, **kwargs), shielded=False)

    return wrapper


def _infrastructure_error(kind: str, reason: str) -> HTTPException:
    return HTTPException(503, detail={"failure_kind": kind, "failure_reason": reason})


def _sandbox_failure(exc: SandboxError) -> HTTPException:
    kind = (
        failure_kinds.SESSION_LOST
        if isinstance(exc, SandboxDeadError)
        else failure_kinds.PROVIDER_UNAVAILABLE
    )
    return _infrastructure_error(kind, f"{type(exc).__name__}: {exc}")


def _seed_error(exc: Exception) -> HTTPException:
    if isinstance(exc, HTTPException):
        return exc
    if isinstance(exc, TaskSetupError | ConfigError):  # the task is broken: fix the dataset
        return HTTPException(422, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, SandboxStartError | TooManySandboxesError | BackendUnavailableError):
        return _infrastructure_error(
            failure_kinds.PROVIDER_UNAVAILABLE, f"no sandbox could start: {exc}"
        )
    if isinstance(exc, SandboxError):
        return _sandbox_failure(exc)
    return HTTPException(500, f"the session could not start: {type(exc).__name__}: {exc}")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _outcome(reward: float, info: Mapping[str, Any], turns: int) -> _Outcome:
    return _Outcome(
        reward=float(reward),
        components=dict(info.get("reward_components", {})),
        details=dict(info.get("verifier", {})),
        termination=str(info.get("termination", "")),
        turns=turns,
    )


# -- the resources server --------------------------------------------------------------------


class RollboxResourcesServer(SimpleResourcesServer):
    """A NeMo Gym resources server: one rollbox sandbox per session, scored by its task."""

    ray_enabled = False
    config: RollboxResourcesServerConfig

    _sessions: _Sessions | None = PrivateAttr(default=None)

    @property
    def sessions(self) -> _Sessions:
        if self._sessions is None:
            self._sessions = _Sessions(self.config)
        return self._sessions

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/run_command")(self.run_command)
        app.post("/write_file")(self.write_file)
        app.post("/read_file")(self.read_file)

        serve = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
            async with serve(app) as state:
                try:
                    yield state
                finally:
                    await _on_rollbox_loop(self.sessions.end_all())

        app.router.lifespan_context = lifespan
        return app

    async def seed_session(  # type: ignore[override]
        self, request: Request, body: ResourcesSeedSessionRequest | RollboxSeedSessionRequest
    ) -> ResourcesSeedSessionResponse | RollboxSeedSessionResponse:
        """Start the task's sandbox for this session; a repeated seed returns the same session.

        Raises HTTPException: 409 if the session ended or was seeded with another task, 422 for
        a bad task (the message names the field), 503 if no sandbox could be had.
        """
        cookie_key = request.session.get(SESSION_ID_KEY)
        if isinstance(body, RollboxSeedSessionRequest):  # an agent's /run: the cookie's session
            session = await _on_rollbox_loop(
                self.sessions.seed(cookie_key, _canonical(body.task), body.task)
            )
            return RollboxSeedSessionResponse(
                task_id=session.task.id, sandbox_id=session.sandbox_id
            )
        key = body.resources_session_id
        if cookie_key != key and cookie_key in self.sessions.live:
            # A tool call is a POST the model chose: it must not swap its session for another
            # one (with a task of its own making) under the same cookie.
            raise HTTPException(409, "this client already has a live session: close it first")
        task_data = body.task_data.get("task")
        if not isinstance(task_data, dict):
            raise HTTPException(422, "task_data.task must be a rollbox task (an object of fields)")
        episode = body.episode_id.model_dump()
        identity = _canonical([episode, body.task_id.model_dump()])
        await _on_rollbox_loop(self.sessions.seed(key, identity, task_data, episode=episode))
        request.session[SESSION_ID_KEY] = key  # tool calls and verify name the session by cookie
        return ResourcesSeedSessionResponse(resources_session_id=key)

    async def run_command(self, request: Request, body: RunCommandRequest) -> ToolOutput:
        """Run a shell command in the session's sandbox."""
        return await self._step(request, Bash(command=body.command))

    async def write_file(self, request: Request, body: WriteFileRequest) -> ToolOutput:
        """Write a text file in the session's sandbox."""
        return await self._step(request, WriteFile(path=body.path, content=body.content))

    async def read_file(self, request: Request, body: ReadFileRequest) -> ToolOutput:
        """Read a text file in the session's sandbox."""
        return await self._step(request, ReadFile(path=body.path))

    async def _step(self, request: Request, action: Bash | WriteFile | ReadFile) -> ToolOutput:
        key = request.session.get(SESSION_ID_KEY)
        return await _on_rollbox_loop(self.sessions.step(key, action))

    async def verify(  # type: ignore[override]
        self, request: Request, body: RollboxVerifyRequest
    ) -> RollboxVerifyResponse:
        """Score the session's sandbox with its task's verifier (once; repeats get the same).

        The task is the one the session was seeded with, whatever the body says.

        Raises HTTPException: 404/410 if the session is unknown, ended or expired, 503 if its
        sandbox died: then the rollout has no valid reward.
        """
        key = request.session.get(SESSION_ID_KEY)
        session, outcome = await _on_rollbox_loop(self.sessions.verify(key))
        return RollboxVerifyResponse(
            **body.model_dump()
            | {
                "reward": outcome.reward,
                "reward_components": outcome.components,
                "task_id": session.task.id,
                "termination": outcome.termination,
                "turns": outcome.turns,
                "verifier_details": outcome.details,
            }
        )

    async def close_resources_session(  # type: ignore[override]
        self, request: Request, body: ResourcesCloseSessionRequest | CloseCookieSessionRequest
    ) -> ResourcesCloseSessionResponse | BaseSeedSessionResponse:
        """Kill the session's sandbox. Closing twice, or a session never seeded, succeeds; a
        seed that comes after the close is refused."""
        cookie_key = request.session.get(SESSION_ID_KEY)
        if isinstance(body, CloseCookieSessionRequest):
            await _on_rollbox_loop(self.sessions.end(cookie_key, "closed"))
            return BaseSeedSessionResponse()
        key = body.resources_session_id
        if cookie_key != key and cookie_key in self.sessions.live:
            raise HTTPException(409, "this client's cookie names another live session")
        self.sessions.check_close(key, body.episode_id.model_dump())
        await _on_rollbox_loop(self.sessions.end(key, "closed"))
        return ResourcesCloseSessionResponse(resources_session_id=key)


# -- NeMo Gym sandbox provider ---------------------------------------------------------------


class RollboxSandboxProvider:
    """NeMo Gym's sandbox provider contract on a rollbox backend.

    Args:
        backend: the rollbox provider that runs the sandboxes (``local``, ...).
        limits: default rollbox ``Limits`` fields; ``SandboxSpec.resources`` overrides
            ``cpus``, ``memory_mb`` and ``disk_mb``.
        network: a rollbox ``NetworkConfig`` (``allow_out``, ``deny_out``); default no network.
        default_timeout_s: the timeout of a command given none.
        default_ttl_s: the lifetime of a sandbox whose spec sets no ``ttl_s``; rollbox kills it
            then, whatever happens to this process.

    ``SandboxSpec.image`` is a rollbox template (``python``, the default, or a root filesystem
    directory). Every command runs as one unprivileged user: ``user=`` is refused. GPUs, ports
    and entrypoints are not offered and are refused at ``create``.
    """

    name = "rollbox"

    def __init__(
        self,
        backend: str = "local",
        *,
        limits: Mapping[str, Any] | None = None,
        network: Mapping[str, Any] | None = None,
        default_timeout_s: float = 180.0,
        default_ttl_s: float | None = 3600.0,
    ) -> None:
        provider_class(backend)  # an unknown backend fails here, naming the known ones
        try:
            self._limits = Limits(**dict(limits or {}))
            self._network = NetworkConfig(**dict(network or {}))
        except ValueError as exc:
            raise ConfigError(f"rollbox sandbox provider: {exc}") from exc
        if default_timeout_s <= 0:
            raise ConfigError("rollbox sandbox provider: default_timeout_s must be positive")
        self._backend = backend
        self._default_timeout_s = default_timeout_s
        self._default_ttl_s = default_ttl_s
        self._mine: dict[str, AsyncSandbox] = {}

    @_rollbox_loop_method
    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Start a sandbox and return once it runs commands (and ``spec.workdir`` exists)."""
        limits, network = self._settings(spec)
        try:
            async with asyncio.timeout(spec.ready_timeout_s):
                sandbox = await AsyncSandbox.create(
                    "nemo-gym",
                    from_template=spec.image or "python",
                    limits=limits,
                    network=network,
                    env_vars=dict(spec.env),
                    ttl_seconds=spec.ttl_s if spec.ttl_s is not None else self._default_ttl_s,
                    provider=self._provider(),
                )
                try:
                    if spec.workdir:
                        made = await sandbox.commands.run(
                            f"mkdir -p -- {shlex.quote(spec.workdir)}", cwd="/"
                        )
                        if not made.ok:
                            raise SandboxCreateError(
                                f"rollbox: workdir {spec.workdir!r} cannot be made "
                                f"(writable: /work, /tmp): {made.stderr.strip()}"
                            )
                except BaseException:
                    await asyncio.shield(sandbox.kill())
                    raise
        except TimeoutError as exc:
            raise SandboxCreateError(
                f"rollbox: no sandbox was ready within ready_timeout_s={spec.ready_timeout_s}"
            ) from exc
        except RollboxError as exc:
            raise SandboxCreateError(f"rollbox: {type(exc).__name__}: {exc}") from exc
        self._mine[sandbox.id] = sandbox
        box = _Box(sandbox, spec.workdir or "/work")
        return SandboxHandle(sandbox_id=sandbox.id, provider_name=self.name, raw=box)

    @_rollbox_loop_method
    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        user: str | int | None = None,
        stdin: bytes | None = None,
    ) -> SandboxExecResult:
        """Run ``command`` under ``/bin/sh -c``; a non-zero exit is a result.

        A timeout kills every process the command started and returns ``error_type="timeout"``;
        a dead sandbox returns ``error_type="sandbox"`` (both with exit code 125).
        """
        if user is not None:
            raise ValueError(
                "the rollbox sandbox provider runs every command as its one unprivileged user; "
                f"user={user!r} cannot be honoured"
            )
        timeout = timeout_s if timeout_s is not None else self._default_timeout_s
        try:
            box = _box(handle)
            result = await box.sandbox.commands.run(
                command, cwd=cwd or box.workdir, env=env, timeout_seconds=timeout, stdin=stdin
            )
        except SandboxDeadError as exc:
            return SandboxExecResult(
                stdout=None,
                stderr=f"rollbox sandbox {handle.sandbox_id} is gone: {exc}",
                return_code=SANDBOX_RUNTIME_RETURN_CODE,
                error_type="sandbox",
            )
        if result.timed_out:
            return SandboxExecResult(
                stdout=result.stdout,
                stderr=f"{result.stderr}rollbox command timed out after {timeout:g}s",
                return_code=SANDBOX_RUNTIME_RETURN_CODE,
                error_type="timeout",
            )
        return SandboxExecResult(
            stdout=result.stdout, stderr=result.stderr, return_code=result.exit_code
        )

    @_rollbox_loop_method
    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        """Copy a host file into the sandbox (relative targets land under the workdir)."""
        box = _box(handle)
        source = Path(source_path)
        data, mode = await asyncio.to_thread(lambda: (source.read_bytes(), source.stat().st_mode))
        await box.sandbox.files.write(box.path(target_path), data, mode=mode & 0o777)

    @_rollbox_loop_method
    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path
    ) -> None:
        """Copy a regular file out of the sandbox (a FIFO or device is refused)."""
        box = _box(handle)
        data = await box.sandbox.files.read(box.path(source_path))
        target = Path(target_path)

        def save() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

        await asyncio.to_thread(save)

    @_rollbox_loop_method
    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        return SandboxStatus.RUNNING if _box(handle).sandbox.alive else SandboxStatus.STOPPED

    @_rollbox_loop_method
    async def close(self, handle: SandboxHandle) -> None:
        """Kill the sandbox (already gone counts as success)."""
        await _box(handle).sandbox.kill()
        self._mine.pop(handle.sandbox_id, None)

    @_rollbox_loop_method
    async def aclose(self) -> None:
        """Kill every sandbox this provider instance started and has not closed."""
        sandboxes, self._mine = list(self._mine.values()), {}
        await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)

    def _provider(self) -> Provider:
        return get_provider(self._backend)  # one per backend and event loop, shared

    def _settings(self, spec: SandboxSpec) -> tuple[Limits, NetworkConfig]:
        if spec.entrypoint:
            raise SandboxCreateError(
                "rollbox sandboxes run rollbox's own init: an entrypoint is not supported "
                "(start the program with exec)"
            )
        if spec.ports:
            raise SandboxCreateError("rollbox sandboxes publish no ports (spec.ports is set)")
        resources = spec.resources
        if not isinstance(resources, SandboxResources):  # pragma: no cover - spec converts
            resources = SandboxResources.from_mapping(resources)
        if resources.gpu:
            raise SandboxCreateError("rollbox sandboxes have no GPUs (spec.resources.gpu is set)")
        options = dict(spec.provider_options)
        unknown = sorted(set(options) - {"limits", "network"})
        if unknown:
            raise SandboxCreateError(
                f"unknown rollbox provider_options {unknown}; known: 'limits', 'network'"
            )
        overrides: dict[str, Any] = dict(options.get("limits") or {})
        if resources.cpu is not None:
            overrides["cpus"] = resources.cpu
        if resources.memory_mib is not None:
            overrides["memory_mb"] = resources.memory_mib
        if resources.disk_gib is not None:
            overrides["disk_mb"] = resources.disk_gib * 1024
        try:
            limits = Limits(**{**self._limits.model_dump(), **overrides})
            network = (
                NetworkConfig(**options["network"]) if options.get("network") else self._network
            )
        except ValueError as exc:
            raise SandboxCreateError(f"rollbox: invalid sandbox settings: {exc}") from exc
        return limits, network


@dataclass(frozen=True)
class _Box:
    """What a handle of this provider holds: the sandbox, and where relative paths start."""

    sandbox: AsyncSandbox
    workdir: str

    def path(self, path: str) -> str:
        return sandbox_path(path, self.workdir)


def _box(handle: SandboxHandle) -> _Box:
    if not isinstance(handle.raw, _Box):
        raise TypeError(f"not a handle of the rollbox sandbox provider: {handle.sandbox_id!r}")
    return handle.raw


# -- datasets and the command line -----------------------------------------------------------


def dataset_row(task: Task, *, system_prompt: str | None = None) -> dict[str, Any]:
    """One NeMo Gym JSONL row for ``task``: the prompt and tools the model gets, and the task.

    Raises:
        ConfigError: the task's verifier is a Python callable (only a test command travels).
    """
    if task.verifier is not None and not isinstance(task.verifier, TestsVerifier):
        raise ConfigError(
            f"task {task.id!r}: a Python verifier cannot travel in a dataset row; "
            "give the task a test command verifier"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": task.instruction})
    try:
        data = task.model_dump(mode="json", exclude_defaults=True)
    except ValueError as exc:  # e.g. a binary file that is not UTF-8
        raise ConfigError(f"task {task.id!r} cannot be written as JSON: {exc}") from exc
    return {
        "task_id": task.id,
        "responses_create_params": {"input": messages, "tools": TOOLS},
        "task": data,
    }


def write_dataset(
    tasks: Iterable[Task], path: str | os.PathLike[str], *, system_prompt: str | None = None
) -> int:
    """Write one NeMo Gym row per task to a JSONL file; returns how many."""
    rows = [json.dumps(dataset_row(t, system_prompt=system_prompt)) for t in tasks]
    Path(path).write_text("".join(f"{row}\n" for row in rows), encoding="utf-8")
    return len(rows)


def server_environment(
    config_path: str | os.PathLike[str],
    *,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> dict[str, str]:
    """The environment ``ng_run`` gives the process of a resources server of a NeMo Gym config:
    the config as NeMo Gym's own parser resolves it, and the server's instance name.

    Raises:
        ConfigError: the config defines no such resources server.
    """
    from nemo_gym.global_config import (
        NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
        NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
        GlobalConfigDictParser,
        GlobalConfigDictParserConfig,
    )
    from omegaconf import OmegaConf

    path = Path(config_path).resolve()
    if not path.is_file():
        raise ConfigError(f"{path}: no such NeMo Gym config file")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    servers = [
        key
        for key, value in (raw or {}).items()
        if isinstance(value, dict) and isinstance(value.get("resources_servers"), dict)
    ]
    if name is None and len(servers) != 1:
        raise ConfigError(
            f"{path}: give the resources server to run with --name (found: {servers or 'none'})"
        )
    name = name or servers[0]
    if name not in servers:
        raise ConfigError(f"{path}: no resources server {name!r}; found: {servers or 'none'}")
    instance: dict[str, Any] = {"host": host}
    if port is not None:
        instance["port"] = port
    (implementation,) = raw[name]["resources_servers"]
    initial = OmegaConf.merge(
        GlobalConfigDictParserConfig.NO_MODEL_GLOBAL_CONFIG_DICT,  # only this server runs
        {"config_paths": [str(path)], name: {"resources_servers": {implementation: instance}}},
    )
    resolved = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=initial, skip_load_from_cli=True, skip_load_from_dotenv=True
        )
    )
    return {
        NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME: OmegaConf.to_yaml(resolved),
        NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME: name,
    }


def serve(
    config_path: str | os.PathLike[str],
    *,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> None:
    """Run the rollbox resources server that a NeMo Gym config defines, until interrupted,
    as ``ng_run`` would start it (without the model and agent servers).

    Raises:
        ConfigError: the config defines no such resources server.
    """
    os.environ.update(server_environment(config_path, name=name, host=host, port=port))
    RollboxResourcesServer.run_webserver()


def main(argv: list[str] | None = None) -> int:
    """``python -m rollbox.integrations.nemo_gym serve CONFIG | dataset TASKS``."""
    parser = argparse.ArgumentParser(prog="python -m rollbox.integrations.nemo_gym")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="run the rollbox resources server of a NeMo Gym config")
    run.add_argument("config", help="a NeMo Gym config YAML")
    run.add_argument("--name", help="the resources server instance (if the config has several)")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int)
    data = commands.add_parser("dataset", help="write NeMo Gym JSONL rows for rollbox tasks")
    data.add_argument("tasks", help="a JSONL file of tasks, a task directory, or a folder of them")
    data.add_argument("-o", "--output", help="the JSONL file to write (default: stdout)")
    data.add_argument("--system-prompt", help="a system message before each task's instruction")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            serve(args.config, name=args.name, host=args.host, port=args.port)
            return 0
        tasks = load_tasks(args.tasks)
        if args.output:
            count = write_dataset(tasks, args.output, system_prompt=args.system_prompt)
            print(f"wrote {count} rows to {args.output}", file=sys.stderr)
        else:
            for task in tasks:
                print(json.dumps(dataset_row(task, system_prompt=args.system_prompt)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # run the module's canonical copy, not __main__'s: NeMo Gym and entry points import that one
    from rollbox.integrations.nemo_gym import main as _main

    sys.exit(_main())
