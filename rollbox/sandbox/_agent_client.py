"""The host side of rollbox's in-sandbox agent (``_agent.py``), shared by the local and Docker backends.

A backend starts the agent as its sandbox's PID 1, hands ``AgentSandbox`` a writer to the
agent's stdin, and runs :func:`read_agent` on the agent's stdout. Commands, files, kill-all,
the TTL and snapshot captures are then the same requests whatever runs the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from rollbox.errors import CommandError, ConfigError, SandboxDeadError, SandboxFileError
from rollbox.sandbox.base import AsyncProcess, AsyncSandbox, FutureProcess, OutputCallback
from rollbox.sandbox.models import ExecResult, FileEntry, SandboxSpec

HEADER = struct.Struct(">II")
DEFAULT_PATH = "/.rollbox/bin:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
FILE_ERRORS = {
    "not_found": "no such file or directory",
    "is_dir": "is a directory",
    "not_dir": "not a directory",
    "permission": "permission denied",
    "read_only": "read-only file system (only /work, /tmp and overlays are writable)",
    "no_space": "no space left (Limits.disk_mb)",
    "too_big": "file larger than Limits.disk_mb",
    "not_regular": "not a regular file (a FIFO, socket or device)",
}


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class _Reader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


class AgentProcess(FutureProcess):
    """A command running under a sandbox's agent."""

    def __init__(
        self,
        sandbox: AgentSandbox,
        cid: int,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> None:
        super().__init__()
        self._sandbox = sandbox
        self._cid = cid
        self.pid = 0
        self._callbacks = (on_stdout, on_stderr)

    async def kill(self) -> None:
        if self._done.done() or not self._sandbox.alive:
            return
        with contextlib.suppress(SandboxDeadError):
            await self._sandbox._request({"op": "kill", "cid": self._cid})

    async def logs(self) -> tuple[str, str]:
        result = self._result_if_ended()
        if result is not None:
            return result.stdout, result.stderr
        header, body = await self._sandbox._request({"op": "logs", "cid": self._cid})
        split = header["n1"]
        return body[:split].decode(errors="replace"), body[split:].decode(errors="replace")

    def _output(self, stream: int, data: bytes) -> None:
        callback = self._callbacks[stream - 1]
        if callback is not None:
            result = callback(data.decode(errors="replace"))
            if asyncio.iscoroutine(result):
                self._sandbox._background(result)


class AgentSandbox(AsyncSandbox):
    """A sandbox whose PID 1 is rollbox's agent; subclasses start it and tear it down."""

    def __init__(self) -> None:
        super().__init__()
        self.spec = SandboxSpec()
        self._writer: _Writer | None = None
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self._streams: dict[int, Callable[[bytes], None]] = {}
        self._processes: dict[int, AgentProcess] = {}
        self._next_id = 1
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._dead = False
        self._death_reason = "killed"
        self._death_kind = "killed"
        self._ttl_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._template_env: dict[str, str] = {}  # the environment its template sets

    def _check_loop(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise ConfigError(
                f"sandbox {self.id} belongs to the event loop that created it and was used from "
                "another; keep one loop (a server's per-request loops will not do), or use the "
                "sync API (rollbox.Sandbox), which runs every sandbox on one shared loop"
            )

    def _expire(self) -> None:
        self._death_reason = f"its TTL of {self.spec.ttl_seconds}s ran out"
        self._death_kind = "ttl"
        self._background(self.kill())

    def _agent_gone(self) -> None:
        """The agent's stream ended: the sandbox died without ``kill``."""
        if not self._dead:
            self._death_kind = "exited"
            self._death_reason = "its agent exited (TTL, or the sandbox was killed from outside)"
            self._background(self.kill())

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def alive(self) -> bool:
        return not self._dead

    def _dead_error(self) -> SandboxDeadError:
        return SandboxDeadError(
            f"sandbox {self.id} is dead: {self._death_reason}",
            sandbox_id=self.id,
            reason=self._death_kind,
        )

    def _mark_dead(self) -> None:
        self._dead = True
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
        error = self._dead_error()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self._streams.clear()
        for process in self._processes.values():
            process._settle(error=error)
        self._processes.clear()
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()

    # -- the agent connection --------------------------------------------------------------

    def _dispatch(self, header: dict[str, Any], body: bytes) -> None:
        op = header["op"]
        if op == "out":
            process = self._processes.get(header["cid"])
            if process is not None:
                process._output(header["s"], body)
        elif op == "exit":
            process = self._processes.pop(header["cid"], None)
            if process is not None:
                split = header["n1"]
                process._settle(
                    result=ExecResult(
                        exit_code=header["code"],
                        stdout=body[:split].decode(errors="replace"),
                        stderr=body[split:].decode(errors="replace"),
                        timed_out=header["timed_out"],
                        truncated=header["truncated"],
                        duration_s=header["duration"],
                    )
                )
        elif op == "chunk":
            sink = self._streams.get(header["rid"])
            if sink is not None:
                sink(body)
        elif op == "ready":
            if not self._ready.done():
                self._ready.set_result(None)
        else:
            self._streams.pop(header["rid"], None)
            future = self._pending.pop(header["rid"], None)
            if future is not None and not future.done():
                future.set_result((header, body))

    def _send(self, header: dict[str, Any], body: bytes = b"") -> int:
        if self._dead:
            raise self._dead_error()
        self._check_loop()
        assert self._writer is not None
        rid = self._next_id
        self._next_id += 1
        header["rid"] = rid
        data = json.dumps(header, separators=(",", ":")).encode()
        self._writer.write(HEADER.pack(len(data), len(body)) + data + body)
        return rid

    async def _request(
        self,
        header: dict[str, Any],
        body: bytes = b"",
        sink: Callable[[bytes], None] | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        rid = self._send(header, body)
        self._pending[rid] = future
        if sink is not None:
            self._streams[rid] = sink
        assert self._writer is not None
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()
        reply, data = await future
        if reply["op"] == "err":
            self._raise(reply, header)
        return reply, data

    def _raise(self, reply: dict[str, Any], request: dict[str, Any]) -> None:
        code, message = reply["code"], reply["msg"]
        if request["op"] == "exec":
            raise CommandError(message, sandbox_id=self.id)
        path = request.get("path", "")
        reason = FILE_ERRORS.get(code, message)
        raise SandboxFileError(f"{request['op']} {path}: {reason}", sandbox_id=self.id)

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
        full_env = {
            "PATH": DEFAULT_PATH,
            "HOME": "/work",
            "USER": "sandbox",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            **self._template_env,
            **env,
        }
        header = {
            "op": "exec",
            "cmd": command,
            "cwd": cwd,
            "env": full_env,
            "timeout": timeout_seconds,
            "limit": self.spec.limits.output_bytes,
            "stream": on_stdout is not None or on_stderr is not None,
            "stdin": stdin is not None,
        }
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        rid = self._send(header, stdin or b"")
        self._pending[rid] = future
        process = AgentProcess(self, rid, on_stdout, on_stderr)
        self._processes[rid] = process  # registered before any output can arrive
        assert self._writer is not None
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()
        try:
            reply, _ = await future
        except BaseException:
            self._processes.pop(rid, None)
            raise
        if reply["op"] == "err":
            self._processes.pop(rid, None)
            self._raise(reply, header)
        process.pid = reply["pid"]
        return process

    async def _kill_all_processes(self) -> None:
        reply, _ = await self._request({"op": "killall"})
        if reply["survivors"]:
            raise CommandError(
                f"{reply['survivors']} processes survived SIGKILL in {self.id}", sandbox_id=self.id
            )

    async def _write_file(self, path: str, data: bytes, mode: int) -> None:
        if len(data) > self.spec.limits.disk_mb * 1024 * 1024:
            raise SandboxFileError(
                f"write {path}: {len(data)} bytes is more than Limits.disk_mb", sandbox_id=self.id
            )
        await self._request({"op": "write", "path": path, "mode": mode}, data)

    async def _read_file(self, path: str) -> bytes:
        limit = max(self.spec.limits.disk_mb * 1024 * 1024, 64 * 1024 * 1024)
        return (await self._request({"op": "read", "path": path, "limit": limit}))[1]

    async def _list_dir(self, path: str) -> list[FileEntry]:
        reply, _ = await self._request({"op": "list", "path": path})
        base = path.rstrip("/")
        return [
            FileEntry(
                name=name, path=f"{base}/{name}", type=kind, size=size, mode=mode, mtime=mtime
            )
            for name, kind, size, mode, mtime in reply["entries"]
        ]

    async def _remove(self, path: str, recursive: bool) -> None:
        await self._request({"op": "remove", "path": path, "recursive": recursive})

    async def _capture(
        self, paths: list[str], sink: Callable[[bytes], None], *, scan_root: bool = False
    ) -> None:
        """Have the agent stream a tar of ``paths`` (see ``Agent.capture``) into ``sink``."""
        await self._request({"op": "capture", "paths": paths, "scan_root": scan_root}, sink=sink)


async def read_agent(sandbox_ref: weakref.ref[AgentSandbox], stdout: _Reader) -> None:
    """Dispatch the agent's messages to the sandbox until the agent's stream ends."""
    try:
        while True:
            hlen, blen = HEADER.unpack(await stdout.readexactly(HEADER.size))
            header = json.loads(await stdout.readexactly(hlen))
            body = await stdout.readexactly(blen) if blen else b""
            sandbox = sandbox_ref()
            if sandbox is None:
                return
            sandbox._dispatch(header, body)
            del sandbox
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    except asyncio.CancelledError:
        return
    sandbox = sandbox_ref()
    if sandbox is not None:
        sandbox._agent_gone()
