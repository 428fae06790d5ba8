"""The blocking facade: every call runs the async core on one shared event-loop thread."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from rollbox.sandbox.base import AsyncProcess, AsyncSandbox, OutputCallback, Provider
from rollbox.sandbox.models import (
    ExecResult,
    FileEntry,
    Limits,
    NetworkConfig,
    SandboxInfo,
    Snapshot,
)
from rollbox.sandbox.templates import Template

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _forget_loop_in_child() -> None:
    # A forked child (e.g. gymnasium's AsyncVectorEnv worker) has the loop object but not its
    # thread: it must start its own.
    global _loop, _lock
    _loop = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_loop_in_child)


def shared_loop() -> asyncio.AbstractEventLoop:
    """The event loop that the sync API drives, started on first use in a daemon thread."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="rollbox-loop", daemon=True)
            thread.start()
            _loop = loop
        return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on the shared loop and wait for it; Ctrl-C cancels it there.

    On Ctrl-C this waits (up to 10 s) until the cancelled coroutine has finished its cleanup
    (killing sandboxes), so that the interpreter does not exit in the middle of it.
    """
    loop = shared_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError(
            "the sync rollbox API was called from its own event loop; use the async API"
        )
    finished = threading.Event()

    async def tracked() -> T:
        try:
            return await coro
        finally:
            finished.set()

    future = asyncio.run_coroutine_threadsafe(tracked(), loop)
    try:
        return future.result()
    except (KeyboardInterrupt, SystemExit):
        future.cancel()  # the concurrent future ends at once; the loop-side task is what we wait for
        finished.wait(timeout=10)
        raise


class SyncProcess:
    """A background command (sync facade of AsyncProcess)."""

    def __init__(self, process: AsyncProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def wait(self) -> ExecResult:
        return run_sync(self._process.wait())

    def kill(self) -> None:
        run_sync(self._process.kill())

    def logs(self) -> tuple[str, str]:
        return run_sync(self._process.logs())


class SyncCommands:
    """``sandbox.commands`` of the sync facade."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._commands = sandbox.commands

    def run(
        self,
        command: str,
        *,
        cwd: str = "/work",
        timeout_seconds: float | None = 60.0,
        env: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Run a shell command and wait for it (see ``AsyncCommands.run``)."""
        return run_sync(
            self._commands.run(
                command,
                cwd=cwd,
                timeout_seconds=timeout_seconds,
                env=env,
                stdin=stdin,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
            )
        )

    def kill_all(self) -> None:
        """Kill every process running in the sandbox (see ``AsyncCommands.kill_all``)."""
        run_sync(self._commands.kill_all())

    def spawn(
        self,
        command: str,
        *,
        cwd: str = "/work",
        timeout_seconds: float | None = None,
        env: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> SyncProcess:
        """Start a command in the background (see ``AsyncCommands.spawn``)."""
        return SyncProcess(
            run_sync(
                self._commands.spawn(
                    command,
                    cwd=cwd,
                    timeout_seconds=timeout_seconds,
                    env=env,
                    stdin=stdin,
                    on_stdout=on_stdout,
                    on_stderr=on_stderr,
                )
            )
        )


class SyncFiles:
    """``sandbox.files`` of the sync facade."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._files = sandbox.files

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        run_sync(self._files.write(path, data, mode=mode))

    def read(self, path: str) -> bytes:
        return run_sync(self._files.read(path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return run_sync(self._files.read_text(path, encoding))

    def list(self, path: str = "/work") -> list[FileEntry]:
        return run_sync(self._files.list(path))

    def exists(self, path: str) -> bool:
        return run_sync(self._files.exists(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        run_sync(self._files.remove(path, recursive=recursive))

    def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str) -> int:
        return run_sync(self._files.upload_dir(local_dir, remote_dir))

    def download_dir(self, remote_dir: str, local_dir: str | os.PathLike[str]) -> int:
        return run_sync(self._files.download_dir(remote_dir, local_dir))


class Sandbox:
    """A sandbox with a blocking API; the same names as ``AsyncSandbox``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.async_sandbox = sandbox
        self.files = SyncFiles(sandbox)
        self.commands = SyncCommands(sandbox)

    @classmethod
    def create(
        cls,
        name: str | None = None,
        *,
        from_template: str | Template = "python",
        from_snapshot: Snapshot | None = None,
        network: NetworkConfig | None = None,
        limits: Limits | None = None,
        env_vars: dict[str, str] | None = None,
        ttl_seconds: float | None = 3600.0,
        provider: str | Provider = "local",
        wait_for_slot: bool = True,
        slot_timeout_seconds: float = 300.0,
    ) -> Sandbox:
        """Start a sandbox (see ``AsyncSandbox.create``)."""
        return cls(
            run_sync(
                AsyncSandbox.create(
                    name,
                    from_template=from_template,
                    from_snapshot=from_snapshot,
                    network=network,
                    limits=limits,
                    env_vars=env_vars,
                    ttl_seconds=ttl_seconds,
                    provider=provider,
                    wait_for_slot=wait_for_slot,
                    slot_timeout_seconds=slot_timeout_seconds,
                )
            )
        )

    @property
    def id(self) -> str:
        return self.async_sandbox.id

    @property
    def alive(self) -> bool:
        return self.async_sandbox.alive

    @property
    def template_id(self) -> str:
        return self.async_sandbox.template_id

    def info(self) -> SandboxInfo:
        return self.async_sandbox.info()

    def snapshot(self) -> Snapshot:
        """Capture the sandbox's files (see ``AsyncSandbox.snapshot``)."""
        return run_sync(self.async_sandbox.snapshot())

    @staticmethod
    def delete_snapshot(snapshot: Snapshot, *, provider: str | Provider | None = None) -> None:
        """Delete a snapshot (see ``AsyncSandbox.delete_snapshot``)."""
        run_sync(AsyncSandbox.delete_snapshot(snapshot, provider=provider))

    def kill(self) -> None:
        """Kill the sandbox. Idempotent."""
        run_sync(self.async_sandbox.kill())

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} alive={self.alive}>"
