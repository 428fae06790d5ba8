"""The remote backend: sandboxes on a rollbox server (``rollbox serve``), spoken to with httpx.

``RemoteProvider(url, token)`` (or ``ROLLBOX_URL`` / ``ROLLBOX_TOKEN``) gives sandboxes with the
same API and contract as the local backend. The wire protocol, which ``rollbox.server``
implements; JSON bodies are the models below and those of ``models.py``:

    POST   /v1/clients                    open a client lease (NDJSON stream, first line
                                          {"client_id": ...}); when the stream closes, the
                                          server kills every sandbox of that client
    POST   /v1/sandboxes                  CreateRequest -> SandboxState
    GET    /v1/sandboxes                  -> [SandboxInfo] of this client
    GET    /v1/sandboxes/{id}             -> SandboxState
    DELETE /v1/sandboxes/{id}             kill
    POST   /v1/sandboxes/{id}/exec        ExecRequest -> NDJSON stream of ExecEvent
    POST   /v1/sandboxes/{id}/processes/{n}/kill
    GET    /v1/sandboxes/{id}/processes/{n}/logs   -> {"stdout": ..., "stderr": ...}
    PUT    /v1/sandboxes/{id}/files?path=&mode=     raw bytes in
    GET    /v1/sandboxes/{id}/files?path=           raw bytes out
    DELETE /v1/sandboxes/{id}/files?path=&recursive=
    GET    /v1/sandboxes/{id}/dir?path=             -> [FileEntry]

Requests carry ``Authorization: Bearer <token>`` and ``X-Rollbox-Client: <client_id>``. An
error is ``{"error": ErrorInfo}`` whose ``code`` is one of ``ERROR_CODES``; the client raises
the same exception class the server's provider raised.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from rollbox.errors import (
    BackendUnavailableError,
    CommandError,
    ConfigError,
    RollboxError,
    SandboxDeadError,
    SandboxError,
    SandboxFileError,
    SandboxStartError,
    TooManySandboxesError,
)
from rollbox.sandbox.base import AsyncProcess, AsyncSandbox, FutureProcess, OutputCallback, Provider
from rollbox.sandbox.models import ExecResult, FileEntry, SandboxInfo, SandboxSpec

CLIENT_HEADER = "X-Rollbox-Client"

# The closed set of error codes: code -> (exception class, HTTP status). Order matters for
# error_code(): the first class an exception is an instance of wins.
ERROR_CODES: dict[str, tuple[type[RollboxError], int]] = {
    "unauthorized": (ConfigError, 401),
    "too_large": (ConfigError, 413),
    "bad_request": (ConfigError, 400),
    "not_found": (SandboxDeadError, 404),
    "unknown_client": (SandboxDeadError, 404),
    "sandbox_dead": (SandboxDeadError, 410),
    "too_many_sandboxes": (TooManySandboxesError, 429),
    "sandbox_start_failed": (SandboxStartError, 500),
    "file_error": (SandboxFileError, 409),
    "command_error": (CommandError, 400),
    "backend_unavailable": (BackendUnavailableError, 503),
    "internal": (RollboxError, 500),
}
ErrorCode = Literal[
    "unauthorized",
    "too_large",
    "bad_request",
    "not_found",
    "unknown_client",
    "sandbox_dead",
    "too_many_sandboxes",
    "sandbox_start_failed",
    "file_error",
    "command_error",
    "backend_unavailable",
    "internal",
]
# Errors raised by a provider, matched most specific first.
_CODE_OF_CLASS: tuple[tuple[type[RollboxError], str], ...] = (
    (TooManySandboxesError, "too_many_sandboxes"),
    (SandboxStartError, "sandbox_start_failed"),
    (SandboxDeadError, "sandbox_dead"),
    (SandboxFileError, "file_error"),
    (CommandError, "command_error"),
    (ConfigError, "bad_request"),
    (BackendUnavailableError, "backend_unavailable"),
)


def error_code(exc: RollboxError) -> str:
    """The wire code of a rollbox error."""
    for cls, code in _CODE_OF_CLASS:
        if isinstance(exc, cls):
            return code
    return "internal"


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ErrorInfo(_Wire):
    """An error on the wire."""

    code: ErrorCode
    message: str
    sandbox_id: str | None = None


class ConnectRequest(_Wire):
    """Opens a client lease."""

    max_sandboxes: int | None = Field(None, ge=1, description="this client's cap on live sandboxes")


class CreateRequest(_Wire):
    """Create a sandbox."""

    spec: SandboxSpec
    wait_for_slot: bool = True
    slot_timeout_seconds: float = Field(300.0, ge=0, le=3600)


class SandboxState(_Wire):
    """A sandbox as the server reports it."""

    info: SandboxInfo
    spec: SandboxSpec


class ExecRequest(_Wire):
    """Start a command; output is streamed back only for the streams asked for."""

    command: str
    cwd: str = "/work"
    env: dict[str, str] = Field(default_factory=dict)
    stdin_b64: str | None = None
    timeout_seconds: float | None = Field(None, gt=0)
    stream_stdout: bool = False
    stream_stderr: bool = False


class ExecEvent(_Wire):
    """One line of an exec stream: started, stdout, stderr, exit or error."""

    event: Literal["started", "stdout", "stderr", "exit", "error"]
    process: int | None = None
    data: str | None = None
    result: ExecResult | None = None
    error: ErrorInfo | None = None


def exception_from(info: ErrorInfo) -> RollboxError:
    """The exception a wire error stands for."""
    cls, _ = ERROR_CODES[info.code]
    if issubclass(cls, SandboxError):
        return cls(info.message, sandbox_id=info.sandbox_id)
    return cls(info.message)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RemoteProcess(FutureProcess):
    """A command running in a remote sandbox; its output arrives on an NDJSON stream."""

    def __init__(
        self,
        sandbox: RemoteSandbox,
        number: int,
        response: httpx.Response,
        lines: AsyncIterator[str],
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> None:
        super().__init__()
        self._sandbox = sandbox
        self.pid = number
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._reader = asyncio.ensure_future(self._read(response, lines))
        sandbox._processes.add(self)
        self._reader.add_done_callback(lambda _: sandbox._processes.discard(self))

    async def _read(self, response: httpx.Response, lines: AsyncIterator[str]) -> None:
        pending: set[asyncio.Future[Any]] = set()
        try:
            async for line in lines:
                event = ExecEvent.model_validate_json(line)
                if event.event in ("stdout", "stderr"):
                    callback = self._callbacks[event.event]
                    if callback is not None:
                        result = callback(event.data or "")
                        if asyncio.iscoroutine(result):
                            task = asyncio.ensure_future(result)
                            pending.add(task)
                            task.add_done_callback(pending.discard)
                elif event.event == "exit" and event.result is not None:
                    self._settle(result=event.result)
                    return
                elif event.event == "error" and event.error is not None:
                    self._settle(error=self._sandbox._error(event.error))
                    return
            self._settle(error=self._sandbox._lost("the command's output stream ended early"))
        except httpx.HTTPError as exc:
            self._settle(error=self._sandbox._lost(f"the command's output stream broke: {exc}"))
        except asyncio.CancelledError:
            self._settle(error=self._sandbox._lost("the command's output stream was closed"))
        finally:
            await response.aclose()

    async def kill(self) -> None:
        if self._done.done() or not self._sandbox.alive:
            return
        with contextlib.suppress(SandboxDeadError):
            await self._sandbox._call("POST", f"/processes/{self.pid}/kill")

    async def logs(self) -> tuple[str, str]:
        result = self._result_if_ended()
        if result is not None:
            return result.stdout, result.stderr
        data = (await self._sandbox._call("GET", f"/processes/{self.pid}/logs")).json()
        return data["stdout"], data["stderr"]


class RemoteSandbox(AsyncSandbox):
    """A sandbox that lives on a rollbox server."""

    provider_name: ClassVar[str] = "remote"

    def __init__(self, provider: RemoteProvider, state: SandboxState) -> None:
        super().__init__()
        self.id = state.info.id
        self.spec = state.spec
        self._provider = provider
        self._info = state.info.model_copy(update={"provider": "remote"})
        self._death: str | None = None
        self._processes: set[RemoteProcess] = set()
        # The TTL is enforced by the server; the client knows it too, so that `alive` needs no
        # round trip. The server's clock only gives the remaining time, never an instant.
        self._deadline: float | None = None
        if state.info.expires_at is not None:
            remaining = (state.info.expires_at - datetime.now(UTC)).total_seconds()
            if state.spec.ttl_seconds is not None:
                remaining = min(remaining, state.spec.ttl_seconds)
            self._deadline = time.monotonic() + remaining

    @property
    def alive(self) -> bool:
        if self._death is None and self._deadline is not None and time.monotonic() > self._deadline:
            self._death = f"its TTL of {self.spec.ttl_seconds}s ran out"
        return self._death is None

    def info(self) -> SandboxInfo:
        return self._info

    def _check_alive(self) -> None:
        if not self.alive:
            raise SandboxDeadError(f"sandbox {self.id} is dead: {self._death}", sandbox_id=self.id)

    def _mark_dead(self, reason: str) -> None:
        if self._death is None:
            self._death = reason
        self._provider._sandboxes.pop(self.id, None)

    def _error(self, info: ErrorInfo) -> RollboxError:
        exc = exception_from(info)
        if isinstance(exc, SandboxDeadError):
            self._mark_dead(info.message.split(" is dead: ", 1)[-1])
        return exc

    def _lost(self, what: str) -> RollboxError:
        if not self.alive:
            return SandboxDeadError(f"sandbox {self.id} is dead: {self._death}", sandbox_id=self.id)
        return BackendUnavailableError(f"{what} (rollbox server {self._provider.url})")

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        self._check_alive()
        return await self._provider._call(
            method, f"/v1/sandboxes/{self.id}{path}", sandbox=self, **kwargs
        )

    # -- primitives ------------------------------------------------------------------------

    async def _spawn(
        self,
        command: str,
        *,
        cwd: str,
        env: dict[str, str],
        stdin: bytes | None,
        timeout_seconds: float | None,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> AsyncProcess:
        self._check_alive()
        self._provider._check_size(
            len(stdin or b"") * 4 // 3 + len(command), self._provider._max_request_bytes, "request"
        )
        body = ExecRequest(
            command=command,
            cwd=cwd,
            env=env,
            stdin_b64=base64.b64encode(stdin).decode() if stdin is not None else None,
            timeout_seconds=timeout_seconds,
            stream_stdout=on_stdout is not None,
            stream_stderr=on_stderr is not None,
        )
        # No read timeout: the command's own timeout bounds it, and the lease notices a dead server.
        response = await self._provider._call(
            "POST",
            f"/v1/sandboxes/{self.id}/exec",
            sandbox=self,
            stream=True,
            json=body.model_dump(mode="json"),
            timeout=httpx.Timeout(self._provider.timeout_seconds, read=None),
        )
        lines = response.aiter_lines()
        try:
            first = ExecEvent.model_validate_json(await anext(lines))
        except (StopAsyncIteration, httpx.HTTPError, ValueError) as exc:
            await response.aclose()
            raise self._lost(f"the server did not start the command: {exc}") from exc
        except BaseException:
            await response.aclose()
            raise
        if first.event == "error" and first.error is not None:
            await response.aclose()
            raise self._error(first.error)
        assert first.process is not None
        return RemoteProcess(self, first.process, response, lines, on_stdout, on_stderr)

    async def _write_file(self, path: str, data: bytes, mode: int) -> None:
        self._provider._check_size(len(data), self._provider._max_upload_bytes, "upload")
        await self._call("PUT", "/files", params={"path": path, "mode": mode}, content=data)

    async def _read_file(self, path: str) -> bytes:
        return (await self._call("GET", "/files", params={"path": path})).content

    async def _list_dir(self, path: str) -> list[FileEntry]:
        response = await self._call("GET", "/dir", params={"path": path})
        return [FileEntry.model_validate(entry) for entry in response.json()]

    async def _remove(self, path: str, recursive: bool) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._call("DELETE", "/files", params=params)

    async def kill(self) -> None:
        if self._death is not None:
            return
        self._mark_dead("killed")
        with contextlib.suppress(SandboxDeadError):
            await self._provider._call("DELETE", f"/v1/sandboxes/{self.id}")


class RemoteProvider(Provider):
    """Sandboxes on a rollbox server.

    Args:
        url: the server, e.g. ``http://10.0.0.5:8000``; default ``ROLLBOX_URL``.
        token: its bearer token; default ``ROLLBOX_TOKEN`` (none for a loopback server
            started without one).
        max_sandboxes: this client's cap on live sandboxes, enforced by the server.
        timeout_seconds: connect and read timeout of each request (commands excepted).

    The provider holds one long-lived connection to the server (a lease): when it closes
    (``close()``, the process exits or dies, the network drops), the server kills every
    sandbox this provider made.
    """

    name: ClassVar[str] = "remote"

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        max_sandboxes: int | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        url = url or os.environ.get("ROLLBOX_URL")
        if not url:
            raise ConfigError(
                "provider 'remote' needs the server's address: RemoteProvider(url=...) or "
                "ROLLBOX_URL=http://HOST:8000 (start a server with `rollbox serve`)"
            )
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"rollbox server URL {url!r} must look like http://HOST:PORT")
        if max_sandboxes is not None and max_sandboxes < 1:
            raise ConfigError("max_sandboxes must be at least 1")
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("ROLLBOX_TOKEN") or None
        self.max_sandboxes = max_sandboxes
        self.timeout_seconds = timeout_seconds
        self._http: httpx.AsyncClient | None = None
        self._client_id: str | None = None
        self._lease: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._sandboxes: dict[str, RemoteSandbox] = {}
        self._closed = False
        self._max_upload_bytes: int | None = None  # the server's limits, learnt with the lease
        self._max_request_bytes: int | None = None

    # -- transport -------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            # Every running command holds a connection; the defaults would cap them at 100.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            # Headers and body go out as separate writes: without TCP_NODELAY, Nagle's
            # algorithm holds the body for the server's delayed ACK (~40 ms a request).
            transport = httpx.AsyncHTTPTransport(
                limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
            )
            self._http = httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                transport=transport,
                timeout=self.timeout_seconds,
                # a loopback server is never reached through a proxy from the environment
                trust_env=not is_loopback_host(urlsplit(self.url).hostname or ""),
            )
        return self._http

    async def _call(
        self,
        method: str,
        path: str,
        *,
        sandbox: RemoteSandbox | None = None,
        stream: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send a request; a non-2xx answer raises the exception its error code stands for."""
        headers = {CLIENT_HEADER: self._client_id} if self._client_id else {}
        client = self._client()
        request = client.build_request(method, path, headers=headers, **kwargs)
        try:
            response = await client.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(
                f"cannot reach the rollbox server at {self.url}: {exc!r} (is `rollbox serve` "
                "running there? check ROLLBOX_URL)"
            ) from exc
        if response.is_success:
            return response
        try:
            await response.aread()
        finally:
            await response.aclose()
        raise self._failure(response, sandbox)

    def _check_size(self, size: int, limit: int | None, kind: str) -> None:
        """Refuse here what the server would refuse with 413, before sending it."""
        if limit is not None and size > limit:
            raise ConfigError(
                f"request body of {size} bytes is over this server's limit of {limit} bytes "
                f"(the operator raises it with rollbox serve --max-{kind}-mb)"
            )

    def _failure(self, response: httpx.Response, sandbox: RemoteSandbox | None) -> RollboxError:
        try:
            info = ErrorInfo.model_validate(response.json()["error"])
        except (ValueError, KeyError, TypeError):
            return RollboxError(
                f"rollbox server {self.url} answered {response.status_code}: {response.text[:500]}"
            )
        if sandbox is not None:
            return sandbox._error(info)
        return exception_from(info)

    async def _connect(self) -> None:
        """Open the lease if it is not open: the server ties this client's sandboxes to it."""
        if self._closed:
            raise SandboxStartError("this RemoteProvider is closed")
        async with self._connecting:
            if self._lease is not None and not self._lease.done():
                return
            self._client_id = None
            body = ConnectRequest(max_sandboxes=self.max_sandboxes).model_dump(mode="json")
            response = await self._call(
                "POST",
                "/v1/clients",
                stream=True,
                json=body,
                # the server writes a heartbeat every few seconds: silence means it is gone
                timeout=httpx.Timeout(self.timeout_seconds, read=60.0),
            )
            lines = response.aiter_lines()
            try:
                first = json.loads(await anext(lines))
                self._client_id = str(first["client_id"])
                self._max_upload_bytes = first.get("max_upload_bytes")
                self._max_request_bytes = first.get("max_request_bytes")
            except BaseException as exc:
                await response.aclose()
                if isinstance(exc, Exception):
                    raise BackendUnavailableError(
                        f"rollbox server {self.url} did not open a client lease: {exc!r}"
                    ) from exc
                raise
            self._lease = asyncio.ensure_future(self._hold_lease(response, lines))

    async def _hold_lease(self, response: httpx.Response, lines: AsyncIterator[str]) -> None:
        try:
            async for _ in lines:
                pass
        except (httpx.HTTPError, asyncio.CancelledError):
            pass
        finally:
            await response.aclose()
            self._client_id = None
            reason = (
                "its provider was closed"
                if self._closed
                else f"the connection to the rollbox server {self.url} was lost, and the server "
                "kills the sandboxes of a client whose connection closes"
            )
            for sandbox in list(self._sandboxes.values()):
                sandbox._mark_dead(reason)

    # -- the provider contract -------------------------------------------------------------

    async def create(
        self, spec: SandboxSpec, *, wait_for_slot: bool = True, slot_timeout_seconds: float = 300.0
    ) -> RemoteSandbox:
        await self._connect()
        body = CreateRequest(
            spec=spec,
            wait_for_slot=wait_for_slot,
            slot_timeout_seconds=min(slot_timeout_seconds, 3600.0),
        )
        response = await self._call(
            "POST",
            "/v1/sandboxes",
            json=body.model_dump(mode="json"),
            timeout=httpx.Timeout(
                self.timeout_seconds, read=self.timeout_seconds + body.slot_timeout_seconds
            ),
        )
        sandbox = RemoteSandbox(self, SandboxState.model_validate(response.json()))
        self._sandboxes[sandbox.id] = sandbox
        return sandbox

    async def list(self) -> list[SandboxInfo]:
        if self._client_id is None:
            return []  # no lease: this provider has no sandbox
        response = await self._call("GET", "/v1/sandboxes")
        return [
            SandboxInfo.model_validate(item).model_copy(update={"provider": "remote"})
            for item in response.json()
        ]

    async def get(self, sandbox_id: str) -> RemoteSandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is not None and sandbox.alive:
            return sandbox
        if self._client_id is None:
            raise SandboxDeadError(
                f"no live sandbox {sandbox_id!r} in this provider", sandbox_id=sandbox_id
            )
        response = await self._call("GET", f"/v1/sandboxes/{sandbox_id}")
        sandbox = RemoteSandbox(self, SandboxState.model_validate(response.json()))
        self._sandboxes[sandbox.id] = sandbox
        return sandbox

    async def close(self) -> None:
        """Kill every sandbox of this provider and close its connection to the server."""
        self._closed = True
        sandboxes = list(self._sandboxes.values())
        await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)
        if self._lease is not None:
            self._lease.cancel()  # the server kills whatever is left when the lease closes
            await asyncio.gather(self._lease, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None
