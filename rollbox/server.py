"""``rollbox serve``: sandboxes for many clients over HTTP, and any rollbox env over OpenEnv.

Two faces on one FastAPI app:

1. The sandbox API under ``/v1`` (the protocol is documented in ``rollbox.sandbox.remote``,
   whose ``RemoteProvider`` is its client).
2. The OpenEnv protocol for one rollbox environment (``--env``): ``GET /health``, ``/schema``,
   ``/metadata``, ``/state``, ``POST /reset``, ``/step`` and stateful sessions over ``WS /ws``,
   as implemented by the ``openenv`` package's ``HTTPEnvServer`` and spoken by its
   ``EnvClient``. An action is the env's tool call (``{"tool": "bash", "command": ...}``); an
   observation carries its text in ``text``. Over HTTP, where OpenEnv itself has no session,
   ``POST /reset`` returns ``metadata.episode_id`` and ``/step`` and ``/state`` take it.

Security: model-written code runs here, and clients may be strangers to one another.

- Bearer tokens (``ROLLBOX_TOKEN`` or ``--token-file``), required unless the server listens on
  loopback only. Each token is its own identity; within one, each client lease is its own
  scope: a client sees and kills only its own sandboxes, a session only its own episode.
- Clients ask for templates, limits, TTLs and networks; the server grants only what its
  operator allowed (a template is a path on the server's disk: never the client's choice).
- Request bodies are capped (413), WebSocket messages too.
- Nothing outlives its client: a lease or a WebSocket that closes kills its sandboxes at once,
  an exec stream that closes kills its command, and sessions and lease-less sandboxes idle
  past ``idle_timeout_seconds`` are killed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import importlib
import json
import os
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollbox import __version__
from rollbox.errors import (
    BackendUnavailableError,
    ConfigError,
    RollboxError,
    SandboxDeadError,
    TooManySandboxesError,
)
from rollbox.sandbox.base import AsyncProcess, AsyncSandbox, Provider
from rollbox.sandbox.models import Limits, SandboxInfo, SandboxSpec
from rollbox.sandbox.registry import provider_class
from rollbox.sandbox.remote import (
    CLIENT_HEADER,
    ERROR_CODES,
    ConnectRequest,
    CreateRequest,
    ErrorInfo,
    ExecEvent,
    ExecRequest,
    SandboxState,
    error_code,
    is_loopback_host,
)

try:
    from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
except ImportError as _exc:  # pragma: no cover - exercised without the extra
    raise BackendUnavailableError(
        f"rollbox serve needs FastAPI and uvicorn ({_exc}): pip install 'rollbox[server]'"
    ) from _exc

T = TypeVar("T")
MB = 1024 * 1024
_HEARTBEAT_SECONDS = 5.0
_DRAIN_BYTES = 64 * MB  # of an over-limit body, read and dropped before the 413
# OpenEnv's WebSocket error codes (openenv.core.env_server.types.WSErrorCode).
INVALID_JSON = "INVALID_JSON"
UNKNOWN_TYPE = "UNKNOWN_TYPE"
VALIDATION_ERROR = "VALIDATION_ERROR"
EXECUTION_ERROR = "EXECUTION_ERROR"
CAPACITY_REACHED = "CAPACITY_REACHED"
FACTORY_ERROR = "FACTORY_ERROR"
SESSION_ERROR = "SESSION_ERROR"


class ServerConfig(BaseModel):
    """What ``rollbox serve`` serves, and what it allows its clients."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    tokens: tuple[str, ...] = Field((), repr=False)
    env: str | None = Field("rollbox/Shell-v0", description="env id, MODULE:ATTR or tasks path")
    provider: str = "local"
    max_sandboxes: int = Field(256, ge=1, description="live sandboxes, all clients together")
    pool_size: int | None = Field(
        None,
        ge=0,
        description="warm sandboxes kept booted per configuration (None: the provider's)",
    )
    max_sessions: int = Field(128, ge=1, description="OpenEnv sessions at once (WS and HTTP)")
    idle_timeout_seconds: float = Field(600.0, gt=0)
    max_request_bytes: int = Field(16 * MB, ge=1024)
    max_upload_bytes: int = Field(64 * MB, ge=1024)
    templates: tuple[str, ...] = ("python",)
    allow_network: bool = False
    max_limits: Limits = Limits(
        memory_mb=4096, pids=1024, cpus=float(os.cpu_count() or 1), disk_mb=4096,
        output_bytes=16 * MB,
    )  # fmt: skip
    max_ttl_seconds: float = Field(24 * 3600.0, gt=0)

    def check_exposure(self) -> None:
        """Refuse to listen beyond loopback without a token."""
        if not is_loopback_host(self.host) and not self.tokens:
            raise ConfigError(
                f"rollbox serve on {self.host!r} would let anyone who reaches it run code here: "
                "give it a bearer token (ROLLBOX_TOKEN=... or --token-file FILE), or listen on "
                "127.0.0.1"
            )
        if any(len(token) < 16 for token in self.tokens):
            raise ConfigError("a bearer token must be at least 16 characters long")


class ApiError(Exception):
    """An error of the sandbox API, with its wire code."""

    def __init__(self, code: str, message: str, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        self.info = ErrorInfo(code=code, message=message, sandbox_id=sandbox_id)  # type: ignore[arg-type]

    @classmethod
    def of(cls, exc: RollboxError) -> ApiError:
        return cls(error_code(exc), str(exc), getattr(exc, "sandbox_id", None))

    def response(self) -> JSONResponse:
        status = ERROR_CODES[self.info.code][1]
        return JSONResponse({"error": self.info.model_dump(mode="json")}, status_code=status)


class _ProtocolError(Exception):
    """An OpenEnv error reply: a message and one of OpenEnv's codes."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.data = {"message": message, "code": code, **extra}


# -- the sandbox API's bookkeeping ----------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    """A sandbox of the sandbox API, and what runs in it."""

    sandbox: AsyncSandbox
    client: _Client
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0
    processes: dict[int, AsyncProcess] = field(default_factory=dict)
    next_process: int = 1


@dataclass(eq=False)
class _Client:
    """One client scope: a lease (``leased``), or the lease-less requests of one identity."""

    id: str
    identity: str
    max_sandboxes: int | None
    leased: bool
    sandboxes: dict[str, _Entry] = field(default_factory=dict)
    pending: int = 0  # creations under way, counted against the cap
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def live(self) -> int:
        return sum(1 for entry in self.sandboxes.values() if entry.sandbox.alive)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


# -- OpenEnv sessions -----------------------------------------------------------------------


class TextObservation(BaseModel):
    """What an OpenEnv client gets back from reset and step (the ``/schema`` of observations)."""

    text: str = Field(description="the instruction (reset) or what the action printed (step)")
    done: bool = False
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class EpisodeState(BaseModel):
    """The ``/state`` of a session."""

    episode_id: str | None = None
    step_count: int = 0
    task_id: str | None = None
    done: bool = False


_IDLE = object()  # put in a WebSocket session's inbox by the reaper


@dataclass(eq=False)
class _Session:
    id: str
    identity: str
    kind: str  # "ws" or "http"
    env: Any  # AsyncSandboxEnv
    last_activity: float = field(default_factory=time.monotonic)
    busy: bool = False
    closed: bool = False
    episode_id: str | None = None
    step_count: int = 0
    done: bool = False
    inbox: asyncio.Queue[Any] | None = None
    expired: str | None = None  # why the idle reaper ended the episode

    def state(self) -> dict[str, Any]:
        task = self.env.episode_task
        return EpisodeState(
            episode_id=self.episode_id,
            step_count=self.step_count,
            task_id=task.id if task is not None else None,
            done=self.done,
        ).model_dump()


def _json_safe(value: Any) -> Any:
    """``info`` dicts as JSON: anything exotic becomes its string."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value)


def _observation(
    text: str, reward: float | None, done: bool, info: Mapping[str, Any]
) -> dict[str, Any]:
    """OpenEnv's serialized observation: fields under ``observation``, metadata also on top."""
    metadata = _json_safe(info)
    return {
        "observation": {"text": text, "metadata": metadata},
        "reward": reward,
        "done": done,
        "metadata": metadata,
    }


class _ServedEnv:
    """The environment ``--env`` names, as a factory of async episode cores."""

    def __init__(self, target: str) -> None:
        import gymnasium

        import rollbox.envs as envs  # registers rollbox's env ids

        self.target = target
        self.description = ""
        make: Callable[[Provider], Any]
        if target in gymnasium.registry:
            spec = gymnasium.spec(target)
            entry = spec.entry_point
            cls = _load(entry) if isinstance(entry, str) else entry
            kwargs = dict(spec.kwargs or {})
            make = self._wrap(lambda provider: cls(**kwargs, provider=provider))
            self.description = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        elif ":" in target and not Path(target).exists():
            make = self._wrap(self._from_object(_load(target), envs))
        elif Path(target).exists():
            tasks = envs.load_tasks(target)
            make = lambda provider: envs.AsyncSandboxEnv(tasks=tasks, provider=provider)  # noqa: E731
        else:
            raise ConfigError(
                f"--env {target!r} is neither a registered env id (rollbox/Shell-v0, "
                "rollbox/HumanEval-v0), a MODULE:ATTR nor a task file or directory"
            )
        self._make = make
        try:  # fail at start-up, not at the first client
            probe = make(_NoProvider())
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"--env {target!r}: making the env failed: {exc!r}") from exc
        self.own_tasks = bool(probe.tasks) or probe.task is not None
        self.name = target

    @staticmethod
    def _from_object(obj: Any, envs: Any) -> Callable[[Provider], Any]:
        if isinstance(obj, envs.Task):
            return lambda provider: envs.AsyncSandboxEnv(obj, provider=provider)
        if isinstance(obj, list | tuple) and obj and all(isinstance(t, envs.Task) for t in obj):
            return lambda provider: envs.AsyncSandboxEnv(tasks=obj, provider=provider)
        if callable(obj):
            return lambda provider: obj(provider=provider)
        raise ConfigError(
            f"--env object {obj!r} is not a Task, a list of Tasks, an env class or a factory "
            "taking provider="
        )

    @staticmethod
    def _wrap(make: Callable[[Provider], Any]) -> Callable[[Provider], Any]:
        from rollbox.envs import AsyncSandboxEnv

        def core(provider: Provider) -> Any:
            env = make(provider)
            env = getattr(env, "core", env)  # a gymnasium SandboxEnv drives an AsyncSandboxEnv
            if not isinstance(env, AsyncSandboxEnv):
                raise ConfigError(f"--env made a {type(env).__name__}, not a rollbox env")
            return env

        return core

    def new(self, provider: Provider) -> Any:
        return self._make(provider)


def _load(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load {target!r}: {exc}") from exc
    return obj


class _NoProvider(Provider):
    """A provider for constructing envs at start-up, never for running them."""

    name: ClassVar[str] = "none"

    async def create(self, spec: SandboxSpec, **kwargs: Any) -> AsyncSandbox:
        raise BackendUnavailableError("no provider")

    async def list(self) -> list[SandboxInfo]:
        return []

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        raise SandboxDeadError(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)

    async def close(self) -> None:
        pass


class _PolicyProvider(Provider):
    """What OpenEnv sessions create sandboxes through: the server's provider, within policy."""

    name: ClassVar[str] = "server"

    def __init__(self, server: RollboxServer) -> None:
        self._server = server

    async def create(
        self, spec: SandboxSpec, *, wait_for_slot: bool = True, slot_timeout_seconds: float = 300.0
    ) -> AsyncSandbox:
        spec = self._server.check_spec(spec)
        return await self._server.provider.create(
            spec, wait_for_slot=wait_for_slot, slot_timeout_seconds=slot_timeout_seconds
        )

    async def list(self) -> list[SandboxInfo]:
        return []

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        raise SandboxDeadError(f"no sandbox {sandbox_id!r} here", sandbox_id=sandbox_id)

    async def close(self) -> None:
        pass


# -- the server -----------------------------------------------------------------------------


class RollboxServer:
    """The state behind the app: the provider, client scopes, OpenEnv sessions."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._tokens = {token.encode(): _identity(token) for token in config.tokens}
        self.served = _ServedEnv(config.env) if config.env else None
        self._provider: Provider | None = None
        self.clients: dict[tuple[str, str], _Client] = {}
        self.sessions: dict[str, _Session] = {}
        self.http_episodes: dict[tuple[str, str], _Session] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    @property
    def provider(self) -> Provider:
        if self._provider is None:
            raise BackendUnavailableError("the server is not running (no lifespan)")
        return self._provider

    # -- life cycle --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        cls = provider_class(self.config.provider)
        kwargs: dict[str, Any] = {"max_sandboxes": self.config.max_sandboxes}
        if self.config.pool_size is not None:
            kwargs["pool_size"] = self.config.pool_size
        self._provider = cls(**kwargs)
        reaper = asyncio.ensure_future(self._reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
            for session in list(self.sessions.values()):
                await self.close_session(session)
            await self.provider.close()
            self.clients.clear()

    def background(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` to its end even if the request that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- auth --------------------------------------------------------------------------------

    def identity(self, authorization: str | None) -> str | None:
        """The identity a request's Authorization header proves; None if it proves none."""
        if not self._tokens:
            return "anonymous"
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        presented = token.strip().encode()
        found = None
        for known, identity in self._tokens.items():  # compare with every token: no timing hint
            if hmac.compare_digest(known, presented):
                found = identity
        return found

    # -- policy ------------------------------------------------------------------------------

    def check_spec(self, spec: SandboxSpec) -> SandboxSpec:
        """The spec if this server allows it (TTL clamped), else a ConfigError naming the field."""
        config = self.config
        if getattr(spec, "snapshot", None) is not None:
            # A snapshot names a directory on the server's disk: never the client's to pick.
            raise ConfigError("snapshot: this server does not start sandboxes from snapshots")
        if spec.template not in config.templates:
            raise ConfigError(
                f"template {spec.template!r} is not offered by this server (offered: "
                f"{', '.join(config.templates)}; the operator adds one with --template PATH)"
            )
        if spec.network.enabled and not config.allow_network:
            raise ConfigError(
                "network.allow_out: this server gives sandboxes no network (the operator allows "
                "it with --allow-network)"
            )
        for name in Limits.model_fields:
            asked, most = getattr(spec.limits, name), getattr(config.max_limits, name)
            if asked > most:
                raise ConfigError(f"limits.{name}={asked} is above this server's maximum of {most}")
        if spec.ttl_seconds is None:
            spec = spec.model_copy(update={"ttl_seconds": config.max_ttl_seconds})
        elif spec.ttl_seconds > config.max_ttl_seconds:
            raise ConfigError(
                f"ttl_seconds={spec.ttl_seconds} is above this server's maximum of "
                f"{config.max_ttl_seconds}"
            )
        return spec

    # -- sandbox API -------------------------------------------------------------------------

    def client_of(self, request: Request) -> _Client:
        identity = request.scope["rollbox.identity"]
        client_id = request.headers.get(CLIENT_HEADER, "")
        client = self.clients.get((identity, client_id))
        if client is None:
            if client_id:
                raise ApiError(
                    "unknown_client",
                    f"client {client_id!r} has no open lease here (its sandboxes were killed "
                    "when its connection closed)",
                )
            client = self.clients[(identity, "")] = _Client("", identity, None, leased=False)
        return client

    def entry(self, request: Request, sandbox_id: str) -> _Entry:
        entry = self.client_of(request).sandboxes.get(sandbox_id)
        if entry is None:  # another client's sandbox looks exactly like one that never was
            raise ApiError(
                "not_found", f"no sandbox {sandbox_id!r} of this client", sandbox_id=sandbox_id
            )
        entry.last_used = time.monotonic()
        return entry

    async def open_client(self, identity: str, body: ConnectRequest) -> _Client:
        cap = body.max_sandboxes
        if cap is not None and cap > self.config.max_sandboxes:
            cap = self.config.max_sandboxes
        client = _Client(secrets.token_urlsafe(16), identity, cap, leased=True)
        self.clients[(identity, client.id)] = client
        return client

    async def drop_client(self, client: _Client) -> None:
        """Forget a client and kill its sandboxes."""
        self.clients.pop((client.identity, client.id), None)
        entries = list(client.sandboxes.values())
        client.sandboxes.clear()
        await asyncio.gather(*(e.sandbox.kill() for e in entries), return_exceptions=True)

    async def create_sandbox(self, client: _Client, body: CreateRequest) -> AsyncSandbox:
        spec = self.check_spec(body.spec)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.slot_timeout_seconds
        cap = client.max_sandboxes
        while cap is not None and client.live() + client.pending >= cap:
            if not body.wait_for_slot:
                raise TooManySandboxesError(
                    f"this client's {cap} sandboxes are live (RemoteProvider(max_sandboxes=...)); "
                    "kill some, or create with wait_for_slot=True"
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TooManySandboxesError(
                    f"no sandbox slot freed within {body.slot_timeout_seconds}s ({cap} live)"
                )
            # a TTL death does not notify: look again at least every quarter second
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.changed.wait(), min(remaining, 0.25))
        client.pending += 1
        try:
            sandbox = await self.provider.create(
                spec,
                wait_for_slot=body.wait_for_slot,
                slot_timeout_seconds=max(0.0, deadline - loop.time()),
            )
        finally:
            client.pending -= 1
        if (client.identity, client.id) not in self.clients:  # the lease closed meanwhile
            await sandbox.kill()
            raise ApiError("unknown_client", f"client {client.id!r} disconnected")
        client.sandboxes[sandbox.id] = _Entry(sandbox, client)
        return sandbox

    async def kill_sandbox(self, entry: _Entry) -> None:
        entry.client.sandboxes.pop(entry.sandbox.id, None)
        try:
            await entry.sandbox.kill()
        finally:
            entry.client.notify()

    async def exec_stream(
        self, entry: _Entry, number: int, waiter: asyncio.Future[Any], queue: asyncio.Queue[Any]
    ) -> AsyncIterator[bytes]:
        """The NDJSON lines of one command: started, its output, then exit or error."""
        try:
            yield _line(ExecEvent(event="started", process=number))
            while (item := await queue.get()) is not None:
                yield _line(ExecEvent(event=item[0], data=item[1]))
            try:
                result = waiter.result()
            except RollboxError as exc:
                yield _line(ExecEvent(event="error", error=ApiError.of(exc).info))
            else:
                yield _line(ExecEvent(event="exit", result=result))
        finally:
            # The client is gone (or done): its command must not run on unwatched. Not awaited:
            # this generator may be in a cancelled scope.
            process = entry.processes.pop(number, None)
            if process is not None and not waiter.done():
                self.background(process.kill())

    # -- OpenEnv sessions --------------------------------------------------------------------

    def open_session(self, identity: str, kind: str) -> _Session:
        if self.served is None:
            raise _ProtocolError(FACTORY_ERROR, "this server serves no env (rollbox serve --env)")
        if len(self.sessions) >= self.config.max_sessions:
            raise _ProtocolError(
                CAPACITY_REACHED,
                f"Server at capacity: {len(self.sessions)}/{self.config.max_sessions} sessions "
                "active. Cannot accept new connections.",
                active_sessions=len(self.sessions),
                max_sessions=self.config.max_sessions,
            )
        try:
            env = self.served.new(_PolicyProvider(self))
        except Exception as exc:
            raise _ProtocolError(
                FACTORY_ERROR, f"cannot make env {self.served.name}: {exc}",
                factory_name=self.served.name,
            ) from exc  # fmt: skip
        session = _Session(str(uuid.uuid4()), identity, kind, env)
        self.sessions[session.id] = session
        return session

    async def close_session(self, session: _Session) -> None:
        """End a session: its sandbox is killed."""
        session.closed = True
        self.sessions.pop(session.id, None)
        if session.episode_id is not None:
            key = (session.identity, session.episode_id)
            if self.http_episodes.get(key) is session:
                del self.http_episodes[key]
        with contextlib.suppress(Exception):
            await session.env.close()

    async def reset(self, session: _Session, data: Mapping[str, Any]) -> dict[str, Any]:
        known = {"seed", "episode_id", "task_id", "task"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise _ProtocolError(
                VALIDATION_ERROR, f"unknown reset field(s) {unknown}; known: {sorted(known)}"
            )
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise _ProtocolError(VALIDATION_ERROR, f"seed must be an integer >= 0, got {seed!r}")
        options: dict[str, Any] = {}
        if data.get("task_id") is not None:
            options["task_id"] = data["task_id"]
        if data.get("task") is not None:
            if self.served is not None and self.served.own_tasks:
                raise _ProtocolError(
                    VALIDATION_ERROR,
                    f"{self.served.name} serves its own tasks: pick one with task_id, not task",
                )
            options["task"] = data["task"]
        episode_id = data.get("episode_id")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise _ProtocolError(VALIDATION_ERROR, "episode_id must be a string of <= 255 chars")
        session.expired = None
        text, info = await self._run(session, session.env.reset(seed=seed, options=options))
        session.episode_id = episode_id or str(uuid.uuid4())
        session.step_count = 0
        session.done = False
        info = {**info, "episode_id": session.episode_id}
        return _observation(text, None, False, info)

    async def step(self, session: _Session, action: Any) -> dict[str, Any]:
        if not isinstance(action, Mapping):
            raise _ProtocolError(
                VALIDATION_ERROR,
                'an action is a tool call object such as {"tool": "bash", "command": "ls"}',
            )
        if session.expired is not None:
            raise _ProtocolError(SESSION_ERROR, session.expired)
        # OpenEnv's typed Action models carry a metadata field of their own: not the tool's.
        action = {k: v for k, v in action.items() if k != "metadata"}
        text, reward, terminated, truncated, info = await self._run(
            session, session.env.step(action)
        )
        session.step_count += 1
        session.done = terminated or truncated
        info = {
            **info,
            "episode_id": session.episode_id,
            "terminated": terminated,
            "truncated": truncated,
        }
        return _observation(text, float(reward), session.done, info)

    async def _run(self, session: _Session, coro: Awaitable[T]) -> T:
        """Run a reset or step; rollbox errors become OpenEnv error replies, never observations."""
        session.busy = True
        session.last_activity = time.monotonic()
        try:
            return await coro
        except TooManySandboxesError as exc:
            raise _ProtocolError(CAPACITY_REACHED, str(exc), error_type=type(exc).__name__) from exc
        except ConfigError as exc:
            raise _ProtocolError(VALIDATION_ERROR, str(exc), error_type=type(exc).__name__) from exc
        except RollboxError as exc:
            raise _ProtocolError(EXECUTION_ERROR, str(exc), error_type=type(exc).__name__) from exc
        finally:
            session.busy = False
            session.last_activity = time.monotonic()

    async def handle_message(self, session: _Session, raw: str) -> dict[str, Any] | None:
        """One WebSocket message in, its reply out (None for ``close``)."""
        try:
            message = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _ProtocolError(INVALID_JSON, f"Invalid JSON: {exc}") from exc
        if not isinstance(message, dict):
            raise _ProtocolError(VALIDATION_ERROR, "a message is a JSON object with a type")
        kind = message.get("type", "")
        extra = sorted(set(message) - {"type", "data"})
        if extra:
            raise _ProtocolError(VALIDATION_ERROR, f"unexpected message field(s) {extra}")
        if kind == "reset":
            data = message.get("data") or {}
            if not isinstance(data, dict):
                raise _ProtocolError(VALIDATION_ERROR, "reset data must be an object")
            return {"type": "observation", "data": await self.reset(session, data)}
        if kind == "step":
            if "data" not in message:
                raise _ProtocolError(VALIDATION_ERROR, "a step message needs data (the action)")
            return {"type": "observation", "data": await self.step(session, message["data"])}
        if kind == "state":
            return {"type": "state", "data": session.state()}
        if kind == "close":
            return None
        raise _ProtocolError(UNKNOWN_TYPE, f"Unknown message type: {kind}")

    # -- idle reaping ------------------------------------------------------------------------

    async def _reap_forever(self) -> None:
        timeout = self.config.idle_timeout_seconds
        interval = min(max(timeout / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_idle()
            except Exception:  # a bug here must not stop reaping
                import logging

                logging.getLogger("rollbox.server").exception("idle reaping failed")

    async def reap_idle(self) -> None:
        """Kill sessions and lease-less sandboxes idle past the timeout; forget dead sandboxes."""
        timeout = self.config.idle_timeout_seconds
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if session.busy or now - session.last_activity <= timeout:
                continue
            session.last_activity = now
            if session.inbox is not None and session.env.sandbox is not None:
                # The sandbox goes now; the connection stays, so the client's next message
                # learns why (OpenEnv clients reconnect silently to a closed socket).
                session.expired = (
                    f"the episode was idle for more than {timeout:g}s: its sandbox was killed "
                    "(reset to start another)"
                )
                await session.env.close()
            elif session.inbox is not None:  # idle again, with nothing running: close it
                session.inbox.put_nowait(_IDLE)
            else:
                await self.close_session(session)
        for client in list(self.clients.values()):
            for sandbox_id, entry in list(client.sandboxes.items()):
                idle = not client.leased and entry.busy == 0 and now - entry.last_used > timeout
                if idle or not entry.sandbox.alive:
                    client.sandboxes.pop(sandbox_id, None)
                    client.notify()
                    await entry.sandbox.kill()
            if not client.leased and not client.sandboxes:
                self.clients.pop((client.identity, client.id), None)

    async def stats(self) -> dict[str, Any]:
        return {
            "sandboxes": len(await self.provider.list()),
            "sessions": len(self.sessions),
            "clients": sum(1 for c in self.clients.values() if c.leased),
            "max_sandboxes": self.config.max_sandboxes,
            "max_sessions": self.config.max_sessions,
        }


def _identity(token: str) -> str:
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def _line(event: ExecEvent) -> bytes:
    return event.model_dump_json(exclude_none=True).encode() + b"\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


async def _unless_client_leaves(request: Request, coro: Awaitable[T]) -> T:
    """Run ``coro``; cancel it if the client disconnects first (a create may wait minutes)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # it undoes its own work
            if not gone.cancelled() and gone.done():
                raise _ClientGone
    return await work


# -- the ASGI guard: auth and body limits, before any route runs ----------------------------


class _Guard:
    """Checks the bearer token and caps request bodies (413) before the app reads anything."""

    def __init__(self, app: Any, server: RollboxServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        identity = self.server.identity(headers.get("authorization"))
        if scope["type"] == "websocket":
            if identity is None:
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})
                return None
            scope["rollbox.identity"] = identity
            return await self.app(scope, receive, send)
        if identity is None and scope["path"] != "/health":
            return await _reply(
                send, 401, "unauthorized",
                "missing or wrong bearer token (Authorization: Bearer ...; ROLLBOX_TOKEN)",
            )  # fmt: skip
        scope["rollbox.identity"] = identity
        config = self.server.config
        upload = scope["method"] == "PUT" and scope["path"].endswith("/files")
        limit, flag = (
            (config.max_upload_bytes, "--max-upload-mb")
            if upload
            else (config.max_request_bytes, "--max-request-mb")
        )
        declared = headers.get("content-length")
        if declared is not None and not declared.isdigit():
            return await _too_large(send, declared, limit, flag)
        # Read the body here, at most `limit` bytes of it, then replay it to the app.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more and (declared is None or int(declared) <= limit):
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > limit:
                break
            chunks.append(chunk)
        if size > limit or (declared is not None and int(declared) > limit):
            # Swallow a bounded rest first: a client still sending when the answer comes would
            # see its connection reset instead of the 413.
            drained = 0
            while more and drained < _DRAIN_BYTES:
                message = await receive()
                drained += len(message.get("body", b""))
                more = message["type"] == "http.request" and message.get("more_body", False)
            return await _too_large(send, declared or f"more than {limit}", limit, flag)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _too_large(send: Any, size: str, limit: int, flag: str) -> None:
    await _reply(
        send, 413, "too_large",
        f"request body of {size} bytes is over this server's limit of {limit} bytes "
        f"(the operator raises it with rollbox serve {flag})",
    )  # fmt: skip


async def _reply(send: Any, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}, "detail": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# -- the app --------------------------------------------------------------------------------


def create_app(config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app of ``rollbox serve``; ``app.state.rollbox`` is its ``RollboxServer``."""
    config = config or ServerConfig()
    config.check_exposure()
    server = RollboxServer(config)
    app = FastAPI(
        title="rollbox",
        version=__version__,
        description="Sandboxes over HTTP, and rollbox environments over the OpenEnv protocol.",
        lifespan=server.lifespan,
    )
    app.state.rollbox = server
    app.add_middleware(_Guard, server=server)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; never read

    @app.exception_handler(RollboxError)
    async def _rollbox_error(request: Request, exc: RollboxError) -> JSONResponse:
        return ApiError.of(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        if request.url.path.startswith("/v1/"):
            response = ApiError("bad_request", f"invalid request: {problems}").response()
            response.status_code = 422
            return response
        return JSONResponse({"detail": _json_safe(exc.errors())}, status_code=422)

    _sandbox_routes(app, server)
    _openenv_routes(app, server)
    return app


def _sandbox_routes(app: FastAPI, server: RollboxServer) -> None:
    @app.post("/v1/clients", tags=["sandboxes"])
    async def open_client(request: Request, body: ConnectRequest) -> StreamingResponse:
        """Open a client lease; the server kills the client's sandboxes when it closes."""
        client = await server.open_client(request.scope["rollbox.identity"], body)

        async def lease() -> AsyncIterator[bytes]:
            gone = asyncio.ensure_future(_wait_disconnect(request))
            try:
                first = {
                    "client_id": client.id,
                    "heartbeat_seconds": _HEARTBEAT_SECONDS,
                    "max_upload_bytes": server.config.max_upload_bytes,
                    "max_request_bytes": server.config.max_request_bytes,
                }
                yield json.dumps(first).encode() + b"\n"
                while not gone.done():
                    await asyncio.wait({gone}, timeout=_HEARTBEAT_SECONDS)
                    if not gone.done():
                        yield b'{"heartbeat": true}\n'
            finally:
                gone.cancel()
                server.background(server.drop_client(client))

        return StreamingResponse(lease(), media_type="application/x-ndjson")

    @app.post("/v1/sandboxes", tags=["sandboxes"])
    async def create(request: Request, body: CreateRequest) -> dict[str, Any]:
        client = server.client_of(request)
        sandbox = await _unless_client_leaves(request, server.create_sandbox(client, body))
        if await request.is_disconnected():
            await server.kill_sandbox(client.sandboxes[sandbox.id])
        return _state(sandbox)

    @app.get("/v1/sandboxes", tags=["sandboxes"])
    async def list_sandboxes(request: Request) -> list[dict[str, Any]]:
        client = server.client_of(request)
        return [
            e.sandbox.info().model_dump(mode="json")
            for e in client.sandboxes.values()
            if e.sandbox.alive
        ]

    @app.get("/v1/stats", tags=["sandboxes"])
    async def stats() -> dict[str, Any]:
        return await server.stats()

    @app.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def get(request: Request, sandbox_id: str) -> dict[str, Any]:
        entry = server.entry(request, sandbox_id)
        if not entry.sandbox.alive:
            raise ApiError("sandbox_dead", f"sandbox {sandbox_id} is dead", sandbox_id)
        return _state(entry.sandbox)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
    async def kill(request: Request, sandbox_id: str) -> Response:
        await server.kill_sandbox(server.entry(request, sandbox_id))
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", tags=["sandboxes"])
    async def exec_command(request: Request, sandbox_id: str, body: ExecRequest) -> Response:
        entry = server.entry(request, sandbox_id)
        try:
            stdin = base64.b64decode(body.stdin_b64, validate=True) if body.stdin_b64 else None
        except (binascii.Error, ValueError) as exc:
            raise ApiError("bad_request", f"stdin_b64 is not base64: {exc}") from exc
        queue: asyncio.Queue[Any] = asyncio.Queue()
        entry.busy += 1
        try:
            process = await entry.sandbox.commands.spawn(
                body.command,
                cwd=body.cwd,
                env=body.env,
                stdin=stdin,
                timeout_seconds=body.timeout_seconds,
                on_stdout=(lambda s: queue.put_nowait(("stdout", s)))
                if body.stream_stdout
                else None,
                on_stderr=(lambda s: queue.put_nowait(("stderr", s)))
                if body.stream_stderr
                else None,
            )
        except BaseException:
            entry.busy -= 1
            raise
        number = entry.next_process
        entry.next_process += 1
        entry.processes[number] = process
        waiter = asyncio.ensure_future(process.wait())

        def finished(done: asyncio.Future[Any]) -> None:
            if not done.cancelled():
                done.exception()  # retrieved, also when the client left before the end
            entry.busy -= 1
            entry.last_used = time.monotonic()
            queue.put_nowait(None)

        waiter.add_done_callback(finished)
        return StreamingResponse(
            server.exec_stream(entry, number, waiter, queue), media_type="application/x-ndjson"
        )

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{number}/kill", status_code=204)
    async def kill_process(request: Request, sandbox_id: str, number: int) -> Response:
        process = server.entry(request, sandbox_id).processes.get(number)
        if process is not None:
            await process.kill()
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{number}/logs")
    async def logs(request: Request, sandbox_id: str, number: int) -> dict[str, str]:
        process = server.entry(request, sandbox_id).processes.get(number)
        if process is None:
            raise ApiError("bad_request", f"no running process {number} in {sandbox_id}")
        stdout, stderr = await process.logs()
        return {"stdout": stdout, "stderr": stderr}

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
    async def write_file(
        request: Request, sandbox_id: str, path: str, mode: int = 0o644
    ) -> Response:
        entry = server.entry(request, sandbox_id)
        if not 0 <= mode <= 0o7777:
            raise ApiError("bad_request", f"mode must be within 0..0o7777, got {mode}")
        await _using(entry, entry.sandbox.files.write(path, await request.body(), mode=mode))
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files", tags=["files"])
    async def read_file(request: Request, sandbox_id: str, path: str) -> Response:
        entry = server.entry(request, sandbox_id)
        data = await _using(entry, entry.sandbox.files.read(path))
        return Response(content=data, media_type="application/octet-stream")

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
    async def remove_file(
        request: Request, sandbox_id: str, path: str, recursive: bool = False
    ) -> Response:
        entry = server.entry(request, sandbox_id)
        await _using(entry, entry.sandbox.files.remove(path, recursive=recursive))
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/dir", tags=["files"])
    async def list_dir(request: Request, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        entry = server.entry(request, sandbox_id)
        entries = await _using(entry, entry.sandbox.files.list(path))
        return [e.model_dump(mode="json") for e in entries]


async def _using(entry: _Entry, coro: Awaitable[T]) -> T:
    entry.busy += 1
    try:
        return await coro
    finally:
        entry.busy -= 1
        entry.last_used = time.monotonic()


def _state(sandbox: AsyncSandbox) -> dict[str, Any]:
    return SandboxState(info=sandbox.info(), spec=sandbox.spec).model_dump(mode="json")


def _openenv_routes(app: FastAPI, server: RollboxServer) -> None:
    def http_error(exc: _ProtocolError) -> JSONResponse:
        status = {
            CAPACITY_REACHED: 503, FACTORY_ERROR: 500, EXECUTION_ERROR: 500, SESSION_ERROR: 404,
        }.get(exc.data["code"], 422)  # fmt: skip
        return JSONResponse({"detail": exc.data}, status_code=status)

    def episode(request: Request, episode_id: Any) -> _Session:
        if not isinstance(episode_id, str) or not episode_id:
            raise _ProtocolError(
                VALIDATION_ERROR,
                "rollbox episodes live in a sandbox: pass the episode_id that POST /reset "
                "returned (metadata.episode_id), or use the WebSocket at /ws",
            )
        session = server.http_episodes.get((request.scope["rollbox.identity"], episode_id))
        if session is None:
            raise _ProtocolError(
                SESSION_ERROR,
                f"no running episode {episode_id!r} (over, idle too long, or not yours)",
            )
        return session

    @app.get("/health", tags=["openenv"])
    async def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/metadata", tags=["openenv"])
    async def metadata() -> dict[str, Any]:
        served = server.served
        return {
            "name": served.name if served else "rollbox",
            "description": (served.description if served else "")
            or "A rollbox environment: each episode runs in its own sandbox.",
            "readme_content": None,
            "version": __version__,
            "author": None,
            "documentation_url": None,
        }

    @app.get("/schema", tags=["openenv"])
    async def schema() -> dict[str, Any]:
        from pydantic import TypeAdapter

        from rollbox.envs.actions import ToolCall

        return {
            "action": TypeAdapter(ToolCall).json_schema(),
            "observation": TextObservation.model_json_schema(),
            "state": EpisodeState.model_json_schema(),
        }

    @app.post("/reset", tags=["openenv"])
    async def reset(request: Request) -> Any:
        try:
            data = await _json_body(request)
            identity = request.scope["rollbox.identity"]
            episode_id = data.get("episode_id")
            session = server.http_episodes.get((identity, episode_id)) if episode_id else None
            if session is None:
                session = server.open_session(identity, "http")
            try:
                reply = await _unless_client_leaves(request, server.reset(session, data))
            except BaseException:
                await server.close_session(session)
                raise
            server.http_episodes[(identity, session.episode_id)] = session  # type: ignore[index]
            return reply
        except _ProtocolError as exc:
            return http_error(exc)

    @app.post("/step", tags=["openenv"])
    async def step(request: Request) -> Any:
        try:
            data = await _json_body(request)
            session = episode(request, data.get("episode_id"))
            if session.busy:
                raise _ProtocolError(VALIDATION_ERROR, "this episode is busy with another step")
            try:
                reply = await server.step(session, data.get("action"))
            except _ProtocolError as exc:
                if exc.data["code"] != VALIDATION_ERROR:
                    await server.close_session(session)  # the episode ended with the error
                raise
            if reply["done"]:
                await server.close_session(session)
            return reply
        except _ProtocolError as exc:
            return http_error(exc)

    @app.get("/state", tags=["openenv"])
    async def state(request: Request, episode_id: str | None = None) -> Any:
        if episode_id is None:
            return EpisodeState().model_dump()
        try:
            return episode(request, episode_id).state()
        except _ProtocolError as exc:
            return http_error(exc)

    @app.websocket("/ws")
    async def websocket(ws: WebSocket) -> None:
        await ws.accept()
        try:
            session = server.open_session(ws.scope["rollbox.identity"], "ws")
        except _ProtocolError as exc:
            await _ws_send(ws, {"type": "error", "data": exc.data})
            await _ws_close(ws)
            return
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        session.inbox = inbox

        async def read() -> None:  # ends when the client goes, however it goes
            try:
                while True:
                    inbox.put_nowait(await ws.receive_text())
            except (WebSocketDisconnect, RuntimeError, KeyError):
                inbox.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                raw = await inbox.get()
                if raw is None or session.closed:
                    return
                if raw is _IDLE:
                    timeout = server.config.idle_timeout_seconds
                    await _ws_send(ws, {"type": "error", "data": {
                        "message": f"session idle for more than {timeout:g}s: its sandbox was "
                        "killed and the session closed",
                        "code": SESSION_ERROR,
                    }})  # fmt: skip
                    return
                work = asyncio.ensure_future(_ws_reply(server, session, raw))
                await asyncio.wait({work, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done():  # the client left mid-step: stop, kill its sandbox
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    return
                reply = work.result()
                if reply is None:
                    return
                await _ws_send(ws, reply)
        finally:
            reader.cancel()
            await asyncio.shield(server.close_session(session))
            await _ws_close(ws)


async def _ws_reply(server: RollboxServer, session: _Session, raw: str) -> dict[str, Any] | None:
    try:
        return await server.handle_message(session, raw)
    except _ProtocolError as exc:
        return {"type": "error", "data": exc.data}
    except Exception as exc:  # never let one message kill the session silently
        return {"type": "error", "data": {"message": str(exc), "code": EXECUTION_ERROR}}


async def _ws_send(ws: WebSocket, message: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps(message))


async def _ws_close(ws: WebSocket) -> None:
    with contextlib.suppress(Exception):
        await ws.close()


async def _json_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise _ProtocolError(INVALID_JSON, f"Invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise _ProtocolError(VALIDATION_ERROR, "the request body must be a JSON object")
    return data


# -- serving --------------------------------------------------------------------------------


def serve(config: ServerConfig, *, log_level: str = "warning") -> None:
    """Run the server until SIGINT/SIGTERM; every sandbox it made is killed on the way out."""
    import socket

    try:
        import uvicorn
    except ImportError as exc:
        raise BackendUnavailableError(
            f"rollbox serve needs uvicorn ({exc}): pip install 'rollbox[server]'"
        ) from exc
    app = create_app(config)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by accepted connections: a response's headers and body are separate writes, and
    # Nagle's algorithm would hold the second one for the client's delayed ACK (~40 ms).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {config.host}:{config.port}: {exc}") from exc
    sock.listen(2048)  # clients that come before uvicorn is up wait in the backlog
    port = sock.getsockname()[1]
    host = f"[{config.host}]" if ":" in config.host else config.host
    served = config.env or "no env"
    auth = f"{len(config.tokens)} bearer token(s)" if config.tokens else "no auth (loopback)"
    print(f"rollbox serve: listening on http://{host}:{port} ({served}; {auth})", flush=True)
    uvicorn_config = uvicorn.Config(
        app,
        log_level=log_level,
        ws_max_size=config.max_request_bytes,
        # leases and running commands are open streams: do not wait on them for ever
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    try:
        uvicorn.Server(uvicorn_config).run(sockets=[sock])
    finally:
        sock.close()


def config_from_args(**kwargs: Any) -> ServerConfig:
    """A ServerConfig with pydantic's errors turned into one ConfigError naming the field."""
    try:
        return ServerConfig(**kwargs)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid server settings: {problems}") from exc


def add_cwd_to_path() -> None:
    """Let ``--env my_module:ATTR`` find modules in the current directory, as uvicorn does."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
