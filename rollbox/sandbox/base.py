"""The provider contract: a few async primitives, and everything else built on them once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

from rollbox.errors import (
    BackendUnavailableError,
    CommandError,
    ConfigError,
    SandboxFileError,
    TooManySandboxesError,
)
from rollbox.sandbox.models import (
    ExecResult,
    FileEntry,
    Limits,
    NetworkConfig,
    SandboxInfo,
    SandboxSpec,
    Snapshot,
)
from rollbox.sandbox.templates import Template

OutputCallback = Callable[[str], Any]


def sandbox_path(path: str, cwd: str = "/work") -> str:
    """Normalise a path inside the sandbox; relative paths are taken from ``cwd``."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConfigError(f"sandbox path {path!r} must be a non-empty string without NUL bytes")
    return posixpath.normpath(posixpath.join(cwd, path))


class AsyncProcess(ABC):
    """A command running in a sandbox (from ``commands.spawn``)."""

    pid: int

    @abstractmethod
    async def wait(self) -> ExecResult:
        """Wait until the command ends and return its result."""

    @abstractmethod
    async def kill(self) -> None:
        """Kill the command and every process it started. Idempotent."""

    @abstractmethod
    async def logs(self) -> tuple[str, str]:
        """The stdout and stderr kept so far."""


class FutureProcess(AsyncProcess):
    """A process whose result arrives on a future: what the providers' processes share."""

    def __init__(self) -> None:
        self._done: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()

    async def wait(self) -> ExecResult:
        return await asyncio.shield(self._done)

    def _settle(
        self, *, result: ExecResult | None = None, error: BaseException | None = None
    ) -> None:
        """Give the process its result or its error; only the first call counts."""
        if self._done.done():
            return
        if error is not None:
            self._done.set_exception(error)
            self._done.exception()  # retrieved: no "never retrieved" warning
        else:
            self._done.set_result(result)  # type: ignore[arg-type]

    def _result_if_ended(self) -> ExecResult | None:
        """The result of a process that has ended with one, else None."""
        if self._done.done() and not self._done.cancelled() and self._done.exception() is None:
            return self._done.result()
        return None


class AsyncSandbox(ABC):
    """One isolated environment, alive until ``kill``. Create it with ``AsyncSandbox.create``."""

    id: str
    spec: SandboxSpec
    provider_name: ClassVar[str]
    _provider: Provider

    @property
    def provider(self) -> Provider:
        """The provider that made this sandbox (to make more like it)."""
        return self._provider

    def __init__(self) -> None:
        self.files = AsyncFiles(self)
        self.commands = AsyncCommands(self)

    @staticmethod
    async def create(
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
    ) -> AsyncSandbox:
        """Start a sandbox.

        Args:
            name: a label shown by ``list``; not unique.
            from_template: ``"python"`` (the host's Python, bash and coreutils, read-only), a
                :class:`~rollbox.sandbox.templates.Template` (built once, then cached), the name
                of a built template (``rollbox template build``), or what the provider knows
                besides: a root filesystem directory (local), an image (docker).
            from_snapshot: start from a snapshot's files (``sandbox.snapshot()``) instead of
                ``from_template``'s; the snapshot's provider must be this one.
            network: outbound policy; default no network at all.
            limits: resource limits; default ``Limits()``.
            env_vars: environment of every command.
            ttl_seconds: the backend kills the sandbox after this long, whatever happens.
            provider: a provider name (``"local"``) or instance.
            wait_for_slot: at the provider's cap, wait for a slot (else raise at once).
            slot_timeout_seconds: how long to wait for a slot.

        Raises:
            ConfigError: a bad argument.
            TooManySandboxesError: no slot, and not waiting or waited too long.
            SandboxStartError: the sandbox could not start.
        """
        from rollbox.sandbox.registry import get_provider

        if from_snapshot is not None:
            if not isinstance(from_snapshot, Snapshot):
                raise ConfigError(
                    f"from_snapshot must be a Snapshot (from sandbox.snapshot()), "
                    f"not {type(from_snapshot).__name__}"
                )
            from_template = from_snapshot.template
        try:
            spec = SandboxSpec(
                name=name,
                template=from_template,
                snapshot=from_snapshot,
                network=network or NetworkConfig(),
                limits=limits or Limits(),
                env_vars=env_vars or {},
                ttl_seconds=ttl_seconds,
            )
        except ValueError as exc:
            raise ConfigError(f"invalid sandbox settings: {exc}") from exc
        backend = provider if isinstance(provider, Provider) else get_provider(provider)
        if from_snapshot is not None and from_snapshot.provider != backend.name:
            raise ConfigError(
                f"snapshot {from_snapshot.id} belongs to the {from_snapshot.provider!r} provider; "
                f"create its sandboxes with provider={from_snapshot.provider!r}"
            )
        return await backend.create(
            spec, wait_for_slot=wait_for_slot, slot_timeout_seconds=slot_timeout_seconds
        )

    async def snapshot(self) -> Snapshot:
        """Capture this sandbox's files (``/work``, ``/tmp`` and its writable root) as a snapshot.

        The sandbox goes on running. Start sandboxes from the snapshot with
        ``AsyncSandbox.create(from_snapshot=snap)``; remove it with ``delete_snapshot``.

        Raises:
            BackendUnavailableError: the provider cannot take snapshots.
            SandboxDeadError: the sandbox is dead.
        """
        return await self._snapshot()

    @staticmethod
    async def delete_snapshot(
        snapshot: Snapshot, *, provider: str | Provider | None = None
    ) -> None:
        """Delete a snapshot (idempotent); its running sandboxes are not affected."""
        from rollbox.sandbox.registry import get_provider

        if provider is None:
            provider = snapshot.provider
        backend = provider if isinstance(provider, Provider) else get_provider(provider)
        await backend.delete_snapshot(snapshot)

    # -- the primitives a provider implements -------------------------------------------------

    @abstractmethod
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
        """Start ``command`` under ``/bin/sh -c``; ``env`` is already merged."""

    async def _snapshot(self) -> Snapshot:
        """Capture the sandbox's filesystem. Providers that can override this."""
        raise BackendUnavailableError(f"the {self.provider_name} provider cannot take snapshots")

    async def _kill_all_processes(self) -> None:
        """Kill every process in the sandbox but its init. Providers with a cheaper way override."""
        result = await self.commands.run(
            "kill -9 -1; sleep 0.05; kill -9 -1; true", cwd="/", timeout_seconds=30
        )
        if result.exit_code != 0:
            raise CommandError(f"could not stop the sandbox's processes: {result.stderr.strip()}")

    @abstractmethod
    async def _write_file(self, path: str, data: bytes, mode: int) -> None:
        """Write a file, creating parent directories."""

    @abstractmethod
    async def _read_file(self, path: str) -> bytes:
        """Read a whole file."""

    @abstractmethod
    async def _list_dir(self, path: str) -> list[FileEntry]:
        """List a directory without following symlinks."""

    @abstractmethod
    async def _remove(self, path: str, recursive: bool) -> None:
        """Remove a file, or a directory with ``recursive``."""

    @abstractmethod
    async def kill(self) -> None:
        """Kill the sandbox: every process, mount and file of it is gone. Idempotent."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """Whether the sandbox still runs."""

    @abstractmethod
    def info(self) -> SandboxInfo:
        """What the provider knows of this sandbox."""

    @property
    def template_id(self) -> str:
        """The identity of the template this sandbox started from."""
        return self.info().template_id

    # -- context manager ----------------------------------------------------------------------

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.kill())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.spec.template!r} alive={self.alive}>"


class AsyncCommands:
    """``sandbox.commands``: run commands in the sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def run(
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
        """Run a shell command and wait for it; a timeout kills its whole process tree.

        ``on_stdout``/``on_stderr`` receive output as it arrives.
        """
        process = await self.spawn(
            command,
            cwd=cwd,
            timeout_seconds=timeout_seconds,
            env=env,
            stdin=stdin,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
        )
        try:
            return await process.wait()
        except asyncio.CancelledError:
            await asyncio.shield(process.kill())
            raise

    async def kill_all(self) -> None:
        """Kill every process running in the sandbox; the sandbox itself stays alive.

        Used before scoring, so that nothing the agent left running can see the hidden tests.

        Raises:
            CommandError: some process survived.
        """
        await self._sandbox._kill_all_processes()

    async def spawn(
        self,
        command: str,
        *,
        cwd: str = "/work",
        timeout_seconds: float | None = None,
        env: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> AsyncProcess:
        """Start a command in the background; it lives until it ends, is killed, or the sandbox is."""
        if not isinstance(command, str) or not command.strip():
            raise ConfigError("command must be a non-empty string")
        if "\0" in command:
            raise ConfigError("command must not contain NUL bytes")
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ConfigError(f"timeout_seconds must be positive, got {timeout_seconds}")
        merged = dict(self._sandbox.spec.env_vars)
        if env:
            for key, value in env.items():
                if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                    raise ConfigError(f"environment variable name {key!r} is invalid")
                merged[key] = str(value)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        return await self._sandbox._spawn(
            command,
            cwd=sandbox_path(cwd),
            env=merged,
            stdin=data,
            timeout_seconds=timeout_seconds,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
        )


class AsyncFiles:
    """``sandbox.files``: the sandbox's filesystem, resolved inside the sandbox only."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` (str is UTF-8 encoded) to ``path``, creating parent directories."""
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, bytes | bytearray | memoryview):
            raise ConfigError(f"file data must be str or bytes, not {type(data).__name__}")
        await self._sandbox._write_file(sandbox_path(path), bytes(data), mode)

    async def read(self, path: str) -> bytes:
        """Read a whole file as bytes."""
        return await self._sandbox._read_file(sandbox_path(path))

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """Read a whole file as text."""
        return (await self.read(path)).decode(encoding, errors="replace")

    async def list(self, path: str = "/work") -> list[FileEntry]:
        """List a directory; symlinks are listed as such and never followed."""
        return await self._sandbox._list_dir(sandbox_path(path))

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists (a dangling symlink counts)."""
        target = sandbox_path(path)
        parent, name = posixpath.split(target)
        if not name:
            return True
        try:
            return any(entry.name == name for entry in await self._sandbox._list_dir(parent))
        except SandboxFileError:
            return False

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file (or a directory tree with ``recursive=True``)."""
        await self._sandbox._remove(sandbox_path(path), recursive)

    async def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str) -> int:
        """Copy a host directory into the sandbox; returns the number of files.

        Symlinks in the host directory are skipped, never followed.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise ConfigError(f"upload_dir: {root} is not a directory")
        target = sandbox_path(remote_dir)
        count = 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not (Path(dirpath) / d).is_symlink()]
            for filename in filenames:
                source = Path(dirpath) / filename
                if source.is_symlink() or not source.is_file():
                    continue
                relative = source.relative_to(root).as_posix()
                await self._sandbox._write_file(
                    posixpath.join(target, relative),
                    source.read_bytes(),
                    source.stat().st_mode & 0o777,
                )
                count += 1
        return count

    async def download_dir(self, remote_dir: str, local_dir: str | os.PathLike[str]) -> int:
        """Copy a sandbox directory to the host; returns the number of files.

        Symlinks in the sandbox are skipped: sandboxed code cannot make this write outside
        ``local_dir`` or read anything but its own files.
        """
        destination = Path(local_dir).resolve()
        destination.mkdir(parents=True, exist_ok=True)
        count = 0
        pending = [(sandbox_path(remote_dir), destination)]
        while pending:
            remote, local = pending.pop()
            for entry in await self._sandbox._list_dir(remote):
                if entry.name in ("", ".", "..") or "/" in entry.name:
                    continue  # a hostile listing cannot steer us out of local_dir
                host_path = local / entry.name
                if host_path.is_symlink():
                    host_path.unlink()  # never write through a link already in the target
                if entry.type == "dir":
                    host_path.mkdir(exist_ok=True)
                    pending.append((entry.path, host_path))
                elif entry.type == "file":
                    host_path.write_bytes(await self._sandbox._read_file(entry.path))
                    count += 1
        return count


class SandboxSlots:
    """A cap on live sandboxes; ``take`` waits (or not) for a free one."""

    def __init__(self, limit: int, owner: str) -> None:
        self.limit = limit
        self.owner = owner  # the provider class, named in the error
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def take(self, wait: bool, timeout: float) -> None:
        loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.used >= self.limit:
            if not wait:
                raise TooManySandboxesError(
                    f"{self.limit} sandboxes are live ({self.owner}(max_sandboxes=...)); "
                    "kill some, or create with wait_for_slot=True"
                )
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise TooManySandboxesError(
                    f"no sandbox slot freed within {timeout}s ({self.limit} live)"
                ) from None
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self.used += 1

    def release(self) -> None:
        """Free a slot; callable from any thread (the garbage collector's included)."""
        self.used -= 1
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_one)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Provider(ABC):
    """A backend that creates sandboxes: ``local``, ``docker``, ``remote``, ``ray``."""

    name: ClassVar[str]

    @abstractmethod
    async def create(
        self, spec: SandboxSpec, *, wait_for_slot: bool = True, slot_timeout_seconds: float = 300.0
    ) -> AsyncSandbox:
        """Start a sandbox for ``spec``."""

    @abstractmethod
    async def list(self) -> list[SandboxInfo]:
        """The live sandboxes of this provider."""

    @abstractmethod
    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A live sandbox by id (raises SandboxDeadError if there is none)."""

    @abstractmethod
    async def close(self) -> None:
        """Kill every sandbox of this provider and release its resources."""

    async def delete_snapshot(self, snapshot: Snapshot) -> None:
        """Delete a snapshot this provider made. Providers with snapshots override this."""
        raise BackendUnavailableError(f"the {self.name} provider has no snapshots")
