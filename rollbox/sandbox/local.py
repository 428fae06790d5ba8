"""The embedded local backend: bubblewrap namespaces, cgroup v1 limits, rlimits and seccomp.

A sandbox is one ``bwrap`` process whose PID 1 is rollbox's agent (``_agent.py``), spoken to
over a pair of pipes. bwrap runs as the unprivileged ``nobody`` user (never as root: a root
bwrap maps the sandbox user to host root), in new user, pid, mount, ipc, uts, net and cgroup
namespaces, with every capability dropped, nested user namespaces disabled and a seccomp filter.
Writable storage is tmpfs created inside the sandbox's own mount namespace, so no mount can
outlive it. Each sandbox has its own memory, pids and cpu cgroups, recorded in a state
directory so that ``cleanup`` reaps what a killed host process left. A sandbox with
``NetworkConfig(allow_out=...)`` is started in a network namespace of its own instead of an
empty one, behind an nftables allow-list (``_netns.py``; root only).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import hashlib
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

from rollbox.errors import (
    BackendUnavailableError,
    ConfigError,
    SandboxDeadError,
    SandboxError,
    SandboxStartError,
)
from rollbox.sandbox import _host, _netns, _seccomp, _snapshots, _spawner
from rollbox.sandbox._agent_client import DEFAULT_PATH, AgentSandbox, read_agent
from rollbox.sandbox.base import Provider, SandboxSlots
from rollbox.sandbox.models import NetworkConfig, SandboxInfo, SandboxSpec, Snapshot
from rollbox.sandbox.templates import BuiltTemplate, build_local, find_local_template

_AGENT_SOURCE = Path(__file__).with_name("_agent.py").read_bytes()
_AGENT_IN_SANDBOX = "/.rollbox/agent.py"
_COMPILED_AGENT_IN_SANDBOX = "/.rollbox/agent.pyc"  # CPython runs a .pyc named as the script
_CGROUP_IN_SANDBOX = "/.rollbox/cg"
_START_TIMEOUT = 15.0
# /etc entries of the host that the python template shows (what anyone may read of them).
_HOST_ETC = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
    "localtime", "nsswitch.conf", "mime.types", "bash.bashrc", "inputrc", "profile",
)  # fmt: skip


def _write_cgroup(path: Path, name: str, value: str) -> None:
    with open(path / name, "w") as handle:
        handle.write(value)


def _apply_limits(cgroups: dict[str, Path], spec: SandboxSpec) -> None:
    limits = spec.limits
    memory = str(limits.memory_mb * 1024 * 1024)
    memory_dir = cgroups["memory"]
    names = ["memory.limit_in_bytes"]
    if (memory_dir / "memory.memsw.limit_in_bytes").exists():
        names.append("memory.memsw.limit_in_bytes")  # no swapping around the limit
    try:  # lowering: the limit first; raising: memsw first
        for name in names:
            _write_cgroup(memory_dir, name, memory)
    except OSError:
        for name in reversed(names):
            _write_cgroup(memory_dir, name, memory)
    _write_cgroup(cgroups["pids"], "pids.max", str(limits.pids))
    _write_cgroup(cgroups["cpu"], "cpu.cfs_period_us", "100000")
    _write_cgroup(cgroups["cpu"], "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * 100000))))


def _pauses(seconds: float) -> Iterator[float]:
    """Pauses between tries for ``seconds``: 0.1 ms, then twice as long each time (up to 4 ms):
    processes killed a moment ago are usually gone within a millisecond."""
    deadline = time.monotonic() + seconds
    pause = 0.0001
    while time.monotonic() < deadline:
        yield pause
        pause = min(pause * 2, 0.004)


def _kill_cgroup_tree(pids_cgroup: Path) -> bool:
    """SIGKILL every process in a pids cgroup and its children; False if there was none."""
    found = False
    for dirpath, _dirs, _files in os.walk(pids_cgroup):
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as handle:
                pids = handle.read().split()
        except OSError:
            continue
        for pid in pids:
            found = True
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
    return found


def _remove_cgroups(cgroups: dict[str, Path]) -> bool:
    """Remove the sandbox cgroups (children first); False if some are still busy."""
    done = True
    for path in cgroups.values():
        if not path.exists():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda t: -len(t[0])):
            try:
                os.rmdir(dirpath)
            except FileNotFoundError:
                pass
            except OSError:
                done = False
    return done


def _destroy_once(pid: int | None, pid_start: int | None, cgroups: dict[str, Path]) -> bool:
    """Kill what is left of a sandbox and remove its cgroups once it is empty; True when gone."""
    if pid and pid_start is not None and _host.process_start_time(pid) == pid_start:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if "pids" in cgroups and cgroups["pids"].exists() and _kill_cgroup_tree(cgroups["pids"]):
        return False
    return _remove_cgroups(cgroups)


_DESTROY_SECONDS = 0.9


def _destroy(pid: int | None, pid_start: int | None, cgroups: dict[str, Path]) -> bool:
    """Kill a sandbox's processes and remove its cgroups. Synchronous, safe to repeat."""
    for pause in _pauses(_DESTROY_SECONDS):
        if _destroy_once(pid, pid_start, cgroups):
            return True
        time.sleep(pause)
    return _destroy_once(pid, pid_start, cgroups)


async def _destroy_async(pid: int | None, pid_start: int | None, cgroups: dict[str, Path]) -> bool:
    """``_destroy`` that waits for the processes' end without holding up the event loop."""
    for pause in _pauses(_DESTROY_SECONDS):
        if _destroy_once(pid, pid_start, cgroups):
            return True
        await asyncio.sleep(pause)
    return _destroy_once(pid, pid_start, cgroups)


class _Record:
    """The state file of one sandbox: enough for another process to reap it."""

    def __init__(self, directory: Path, sandbox_id: str) -> None:
        self.path = directory / f"{sandbox_id}.json"
        self.extra: dict[str, Any] = {}  # kept in every write (the sandbox's network)

    def write(self, **data: Any) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps({**data, **self.extra}))
        os.replace(temporary, self.path)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class LocalSandbox(AgentSandbox):
    """A sandbox of the local backend."""

    provider_name: ClassVar[str] = "local"

    def __init__(self, provider: LocalProvider, sandbox_id: str, pool_key: tuple[Any, ...]) -> None:
        super().__init__()
        self.id = sandbox_id
        self._provider = provider
        self._pool_key = pool_key
        self._record = _Record(provider.state_dir, sandbox_id)
        self._cgroups: dict[str, Path] = {
            name: parent / sandbox_id for name, parent in provider.cgroups.parents.items()
        }
        self._pid: int | None = None  # bwrap's, started by the spawner helper
        self._pid_start: int | None = None
        self._net: _netns.SandboxNet | None = None  # its netns, veth and nft table, if any
        self._reader: asyncio.Task[None] | None = None
        self._template: _Template | None = None
        self._created_at = datetime.now(UTC)
        self._expires_at: datetime | None = None
        self._holds_slot = False
        self._booted_ahead = False
        self._refill_when_killed = False  # its pool's replacement boots when it is killed
        self._stderr_tail = bytearray()
        self._owner_pid = os.getpid()

    # -- life cycle ------------------------------------------------------------------------

    async def _boot(self, template: _Template, disk_mb: int, *, ahead: bool = False) -> None:
        """Start bwrap and the agent; raise SandboxStartError if they do not come up.

        ``ahead``: booted for the pool, at the lowest CPU weight until ``_activate``, so that it
        takes no CPU from the sandboxes at work.
        """
        provider = self._provider
        # Pool keys hold the NetworkConfig: a pooled sandbox is booted with its network.
        network = next((k for k in self._pool_key if isinstance(k, NetworkConfig)), None)
        snapshot = next((k for k in self._pool_key if isinstance(k, Path)), None)
        self._template = template
        self._template_env = template.env
        if network is not None and network.enabled:  # recorded first, so cleanup finds it
            self._record.extra["net"] = _netns.SandboxNet(self.id).record()
        self._record.write(
            id=self.id,
            owner_pid=os.getpid(),
            owner_start=_host.process_start_time(os.getpid()),
            cgroups={k: str(v) for k, v in self._cgroups.items()},
            pid=None,
            pid_start=None,
            expires_at=None,
        )
        try:
            for path in self._cgroups.values():
                path.mkdir()
            # (Limits come with _activate, before any command: only the agent runs until then.)
            # Delegate the pids cgroup to the agent: it makes one child cgroup per command, so a
            # timeout can kill everything the command started. Limits files stay root's.
            for path in (self._cgroups["pids"], self._cgroups["pids"] / "cgroup.procs"):
                os.chown(path, _host.SANDBOX_UID, _host.SANDBOX_UID)
        except OSError as exc:
            self._destroy_now()
            raise SandboxStartError(
                f"cannot set up cgroups for {self.id}: {exc}", sandbox_id=self.id
            ) from exc

        net_fd = -1
        if network is not None and network.enabled:
            setup = asyncio.ensure_future(
                asyncio.to_thread(_netns.setup, self.id, network, str(self._record.path))
            )
            try:
                try:
                    self._net = await asyncio.shield(setup)
                except asyncio.CancelledError:  # the thread goes on: remove what it makes
                    with contextlib.suppress(Exception):
                        self._net = await setup
                    self._destroy_now()
                    raise
                self._record.extra["net"] = self._net.record()
                if self._dead:
                    raise SandboxDeadError(f"sandbox {self.id} was killed while starting")
                net_fd = _netns.open_netns(self._net)  # joined in the child, before bwrap
            except (SandboxError, OSError) as exc:
                self._destroy_now()
                if isinstance(exc, SandboxStartError):
                    raise
                raise SandboxStartError(
                    f"cannot set up the network of {self.id}: {exc}", sandbox_id=self.id
                ) from exc

        seccomp_fd = os.memfd_create("rollbox-seccomp", os.MFD_CLOEXEC)
        os.write(seccomp_fd, provider.seccomp_program)
        os.lseek(seccomp_fd, 0, os.SEEK_SET)
        argv = provider.bwrap_argv(
            template, disk_mb, self._cgroups["pids"], _spawner.SECCOMP_FD_IN_CHILD, snapshot
        )
        if net_fd >= 0:
            argv.remove("--unshare-net")  # it runs in the sandbox's own netns instead
        stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
        stdout_read, stdout_write = os.pipe2(os.O_CLOEXEC)
        stderr_read, stderr_write = os.pipe2(os.O_CLOEXEC)
        child_fds = [stdin_read, stdout_write, stderr_write, seccomp_fd]
        child_fds += [net_fd] if net_fd >= 0 else []
        # The spawner helper forks bwrap (see _spawner.py); off the loop, as it can take a moment.
        spawn = asyncio.ensure_future(
            asyncio.to_thread(
                _spawner.SPAWNER.spawn,
                argv,
                fds=child_fds,
                cgroup_procs=[str(p / "cgroup.procs") for p in self._cgroups.values()],
                home_procs=provider.cgroups.own_procs,  # the spawner was started in them
                uid=_host.SANDBOX_UID,
            )
        )
        try:
            try:  # a cancel lets the spawn finish, then tears the sandbox down
                self._pid, self._pid_start = await asyncio.shield(spawn)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    self._pid, self._pid_start = await spawn
                self._destroy_now()
                raise
        except BaseException as exc:
            for fd in (stdin_write, stdout_read, stderr_read):
                os.close(fd)
            if not isinstance(exc, (OSError, RuntimeError)):  # RuntimeError: loop shutting down
                raise
            self._destroy_now()
            raise SandboxStartError(f"cannot start bwrap: {exc}", sandbox_id=self.id) from exc
        finally:
            for fd in child_fds:
                os.close(fd)
        if ahead:  # not before the spawn: the spawner steps into this cgroup to start bwrap
            with contextlib.suppress(OSError):
                _write_cgroup(self._cgroups["cpu"], "cpu.shares", "2")
                self._booted_ahead = True
        # (The record gets the pid with _activate: until then the reaper finds bwrap through
        # the pids cgroup, which bwrap joined before it started.)
        # The readers hold the sandbox weakly, so an abandoned sandbox is collected (and killed).
        loop = asyncio.get_running_loop()
        stdout = asyncio.StreamReader(limit=1 << 24, loop=loop)
        await loop.connect_read_pipe(lambda: _PipeProtocol(stdout), os.fdopen(stdout_read, "rb", 0))
        stderr = asyncio.StreamReader(loop=loop)
        await loop.connect_read_pipe(lambda: _PipeProtocol(stderr), os.fdopen(stderr_read, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.streams.FlowControlMixin(loop), os.fdopen(stdin_write, "wb", 0)
        )
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)
        self._reader = asyncio.ensure_future(read_agent(weakref.ref(self), stdout))
        stderr_read_to_end = asyncio.ensure_future(_read_stderr(self._stderr_tail, stderr))
        self._background(stderr_read_to_end)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), _START_TIMEOUT)
        except (TimeoutError, SandboxDeadError) as exc:
            await self.kill()
            with contextlib.suppress(Exception):  # what bwrap or the spawner said on the way out
                await asyncio.wait_for(asyncio.shield(stderr_read_to_end), 2)
            detail = bytes(self._stderr_tail).decode(errors="replace").strip()
            raise SandboxStartError(
                f"sandbox {self.id} did not start: {detail or exc or 'timed out'}",
                sandbox_id=self.id,
            ) from exc

    async def _activate(self, spec: SandboxSpec) -> None:
        """Give a booted sandbox its spec: limits, TTL, environment."""
        self.spec = spec
        self._created_at = datetime.now(UTC)
        _apply_limits(self._cgroups, spec)
        if self._booted_ahead:
            _write_cgroup(self._cgroups["cpu"], "cpu.shares", "1024")
        if spec.ttl_seconds is not None:
            self._expires_at = self._created_at + timedelta(seconds=spec.ttl_seconds)
            self._send({"op": "ttl", "seconds": spec.ttl_seconds})  # its reply is not awaited
            self._ttl_handle = asyncio.get_running_loop().call_later(
                spec.ttl_seconds, _expire, weakref.ref(self)
            )
        self._record.write(
            id=self.id,
            owner_pid=os.getpid(),
            owner_start=_host.process_start_time(os.getpid()),
            cgroups={k: str(v) for k, v in self._cgroups.items()},
            pid=self._pid,
            pid_start=self._pid_start,
            expires_at=self._expires_at.timestamp() if self._expires_at else None,
            name=spec.name,
            template=spec.template if isinstance(spec.template, str) else spec.template.name,
        )

    async def kill(self) -> None:
        if self._dead:
            return
        self._check_loop()
        self._mark_dead()
        try:
            if os.getpid() == self._owner_pid:
                if self._net is not None:
                    # the kernel takes ~40 ms to remove a network: not on the loop
                    await asyncio.to_thread(self._destroy_processes_and_network)
                else:  # what _destroy_now then does is done at once
                    await _destroy_async(self._pid, self._pid_start, self._cgroups)
        finally:
            self._destroy_now()  # the slot is given back even if the wait above was cancelled
        if self._writer is not None:
            self._writer.close()
        if self._reader is not None:
            self._reader.cancel()
        if self._refill_when_killed and self._template is not None:
            self._provider._schedule_refill(
                self._pool_key, self._template, self.spec.limits.disk_mb
            )
        snapshot = next((k for k in self._pool_key if isinstance(k, Path)), None)
        if snapshot is not None and snapshot in self._provider._retired:
            await self._provider._release_snapshot(snapshot)

    def _destroy_now(self) -> None:
        """Synchronous teardown: used by kill, by atexit and by the garbage collector."""
        self._dead = True
        if os.getpid() != self._owner_pid:
            return  # a forked child's copy: the sandbox belongs to the parent
        destroyed = _destroy(self._pid, self._pid_start, self._cgroups)
        if self._destroy_network() and destroyed:
            self._record.remove()
        if self._holds_slot:
            self._holds_slot = False
            self._provider._slots.release()

    def _destroy_network(self) -> bool:
        """Remove the sandbox's netns, veth and nft table (after its processes); True when gone."""
        if self._net is not None and _netns.teardown(self._net):
            self._net = None
        return self._net is None

    def _destroy_processes_and_network(self) -> None:
        _destroy(self._pid, self._pid_start, self._cgroups)
        self._destroy_network()

    def __del__(self) -> None:
        if not getattr(self, "_dead", True):
            with contextlib.suppress(Exception):
                self._destroy_now()

    # -- the agent connection --------------------------------------------------------------

    def _oom_kills(self) -> int:
        """How many processes the OOM killer took in this sandbox's memory cgroup."""
        try:
            text = (self._cgroups["memory"] / "memory.oom_control").read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def _agent_gone(self) -> None:
        if not self._dead:
            if self._oom_kills() > 0:
                self._death_kind = "oom"
                self._death_reason = (
                    "the out-of-memory killer ended it: its processes and its files in /work, "
                    "/tmp and /dev/shm (which are RAM) used up Limits.memory_mb"
                )
                self._background(self.kill())
            else:
                super()._agent_gone()

    async def _snapshot(self) -> Snapshot:
        # The agent tars its own /work, /tmp (and, on a root filesystem template, what the
        # sandbox user owns in the root) from inside the sandbox; the host writes it out safely.
        snapshot_id, directory = _snapshots.new_directory()
        try:
            with tempfile.SpooledTemporaryFile(max_size=64 << 20) as spool:
                await self._capture(
                    ["/work", "/tmp"], spool.write, scan_root=self._template.rootfs is not None
                )
                spool.seek(0)
                size = await asyncio.to_thread(_snapshots.extract, spool, directory)
            snapshot = Snapshot(
                id=snapshot_id,
                provider="local",
                template=self.spec.template,
                template_id=self.template_id,
                source_sandbox=self.id,
                created_at=datetime.now(UTC),
                size_bytes=size,
                ref=str(directory),
            )
            _snapshots.publish(snapshot, directory)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(_snapshots.remove_directory, directory))
            raise
        return snapshot

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            name=self.spec.name,
            provider="local",
            template=(
                self.spec.template
                if isinstance(self.spec.template, str)
                else self.spec.template.name
            ),
            template_id=self._template.identity if self._template else "",
            snapshot=self.spec.snapshot.id if self.spec.snapshot else None,
            created_at=self._created_at,
            expires_at=self._expires_at,
        )


class _PipeProtocol(asyncio.StreamReaderProtocol):
    """Holds its reader strongly (asyncio's holds it weakly), so the loop, through the pipe's
    transport, keeps the reader and the task reading it alive until EOF, even once the sandbox
    object is gone."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        super().__init__(reader)
        self.reader = reader


async def _read_stderr(tail: bytearray, stderr: asyncio.StreamReader) -> None:
    """Keep the last 4 KiB of bwrap's and the agent's stderr, for start-up errors."""
    with contextlib.suppress(Exception):
        while chunk := await stderr.read(4096):
            tail += chunk
            del tail[:-4096]


def _expire(sandbox_ref: weakref.ref[LocalSandbox]) -> None:
    sandbox = sandbox_ref()
    if sandbox is not None:
        sandbox._expire()


class _Template:
    """How a template becomes bwrap arguments."""

    def __init__(self, name: str, built: BuiltTemplate | None = None) -> None:
        self.name = name
        self.env: dict[str, str] = {}
        self.layers: list[Path] = []  # the root's read-only layers, lowest first
        self._compiled_agent: Path | bool | None = None  # False: could not be compiled
        if built is None and name != "python" and not Path(name).is_absolute():
            built = find_local_template(name)
            if built is None:
                raise ConfigError(
                    f"template {name!r} is neither 'python' nor a built template (see `rollbox "
                    "template ls`) nor the absolute path of a root filesystem directory"
                )
        if built is not None:
            self.layers = [Path(layer) for layer in built.layers]
            self.rootfs: Path | None = self.layers[0]
            missing = [str(layer) for layer in self.layers if not layer.is_dir()]
            if missing:
                raise ConfigError(
                    f"template {name!r} lost its layers {missing}: build it again "
                    "(`rollbox template build`)"
                )
            self.env = dict(built.env)
            self.python = "/usr/bin/python3"
            self.identity = built.identity
        elif name == "python":
            self.python = _host.template_python()
            self.rootfs = None
            self.identity = f"python:{os.path.basename(self.python)}@{self._python_version()}"
        else:
            rootfs = Path(name)
            if not rootfs.is_absolute() or not rootfs.is_dir():
                raise ConfigError(
                    f"template {name!r} is neither 'python' nor an absolute path of a root "
                    "filesystem directory"
                )
            self.rootfs = rootfs.resolve()
            self.layers = [self.rootfs]
            python = self.rootfs / "usr/bin/python3"
            if not python.exists() and not python.is_symlink():
                raise ConfigError(
                    f"template {name!r} has no /usr/bin/python3; rollbox's in-sandbox agent needs one"
                )
            if not _host.world_reachable(self.rootfs):
                raise ConfigError(
                    f"template {name!r} is not readable by the sandbox user (uid "
                    f"{_host.SANDBOX_UID}): make its parent directories world-searchable (chmod o+x)"
                )
            self.python = "/usr/bin/python3"
            st = self.rootfs.stat()
            self.identity = f"dir:{self.rootfs}@{int(st.st_mtime)}"

    def agent(self, source: Path) -> tuple[Path, str]:
        """The agent file to bind into the sandbox, and where.

        Python compiles a script's source at every start (~5 ms here, a fifth of a sandbox's
        whole life): where the host can run the template's interpreter (the python template),
        it compiles the agent once, and sandboxes run the bytecode. Elsewhere, the source.
        """
        if self.rootfs is None:
            if self._compiled_agent is None:
                self._compiled_agent = _compile_agent(self.python, self.identity, source)
            if self._compiled_agent:
                return self._compiled_agent, _COMPILED_AGENT_IN_SANDBOX
        return source, _AGENT_IN_SANDBOX

    def _python_version(self) -> str:
        try:
            out = subprocess.run(
                [self.python, "-I", "-S", "-c", "import sys;print(sys.version.split()[0])"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        return out or "unknown"

    def root_args(self, etc_dir: Path, snapshot: Path | None = None) -> list[str]:
        if self.rootfs is not None:
            args = [arg for layer in self.layers for arg in ("--overlay-src", str(layer))]
            if snapshot is not None:  # the root files the snapshotted sandbox owned, on top
                args += ["--overlay-src", str(snapshot / "root")]
            return [*args, "--tmp-overlay", "/"]
        args = ["--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{name}"]
        prefix = Path(self.python).parent.parent
        if not str(prefix).startswith("/usr"):
            args += ["--ro-bind", str(prefix), str(prefix)]
        return [*args, "--ro-bind", str(etc_dir), "/etc"]

    def helper_links(self) -> list[str]:
        """``python`` and ``python3`` in /.rollbox/bin (first on PATH) for the python template."""
        if self.rootfs is not None:
            return []
        return [
            "--symlink", self.python, "/.rollbox/bin/python",
            "--symlink", self.python, "/.rollbox/bin/python3",
        ]  # fmt: skip


@functools.cache
def _python_etc(state_dir: Path) -> Path:
    """The python template's /etc: the host's ``_HOST_ETC`` entries that anyone may read, and ours.

    A copy in one directory, bound once: bwrap reads /proc/self/mountinfo again for every bind,
    and a bind per entry cost ~1.6 ms of every sandbox's start. Named by a digest of what is
    in it, so a changed host /etc makes a new one (for the next process) and running sandboxes
    keep theirs.
    """
    ours = {
        "passwd": "root:x:0:0:root:/root:/bin/sh\n"
        f"sandbox:x:{_host.SANDBOX_UID}:{_host.SANDBOX_UID}:sandbox:/work:/bin/bash\n",
        "group": f"root:x:0:\nsandbox:x:{_host.SANDBOX_UID}:\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
        "hostname": "sandbox\n",
        "resolv.conf": "",
    }
    host = [Path("/etc") / name for name in _HOST_ETC if os.path.lexists(f"/etc/{name}")]
    digest = hashlib.sha256(json.dumps(ours, sort_keys=True).encode())
    for entry in host:
        for path in [entry, *(sorted(entry.rglob("*")) if entry.is_dir() else [])]:
            info = path.lstat()
            digest.update(f"{path}\0{info.st_mode}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    etc = state_dir / f"etc-{digest.hexdigest()[:16]}"
    if etc.is_dir():
        return etc
    building = Path(tempfile.mkdtemp(prefix=".etc-", dir=state_dir))
    try:
        for entry in host:
            _copy_public(entry, building / entry.name)
        for name, text in ours.items():
            (building / name).write_text(text)
            os.chmod(building / name, 0o644)
        os.chmod(building, 0o755)
        try:
            building.rename(etc)
        except OSError:  # another process made it first
            if not etc.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return etc


def _copy_public(source: Path, target: Path) -> None:
    """Copy what anyone may read of ``source`` (symlinks as symlinks); skip the rest."""
    info = source.lstat()
    if stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(source), target)
    elif stat.S_ISDIR(info.st_mode) and info.st_mode & 0o005 == 0o005:
        target.mkdir()
        for child in source.iterdir():
            _copy_public(child, target / child.name)
        os.chmod(target, stat.S_IMODE(info.st_mode) & 0o755)
    elif stat.S_ISREG(info.st_mode) and info.st_mode & 0o004:
        shutil.copyfile(source, target)
        os.chmod(target, stat.S_IMODE(info.st_mode) & 0o755)


def _compile_agent(python: str, identity: str, source: Path) -> Path | bool:
    """The agent's bytecode for ``python``, next to its source; False if it cannot be made."""
    digest = hashlib.sha256(f"{identity}\0{python}".encode()).hexdigest()[:12]
    target = source.with_name(f"{source.stem}-{digest}.pyc")
    if target.exists():
        return target
    temporary = _host.temporary_beside(target)
    try:
        subprocess.run(
            [
                python, "-I", "-S", "-c",
                "import py_compile, sys; py_compile.compile(sys.argv[1], sys.argv[2], doraise=True)",
                str(source), str(temporary),
            ],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    except (OSError, subprocess.SubprocessError):
        with contextlib.suppress(OSError):
            temporary.unlink()
        return False
    return target


def _int_from_env(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} must be an integer") from None


class LocalProvider(Provider):
    """Sandboxes on this machine, with bubblewrap and cgroups.

    Args:
        max_sandboxes: cap on live sandboxes; past it ``create`` waits for a slot.
        pool_size: sandboxes kept booted ahead of demand for each of the last
            ``MAX_POOLED_CONFIGS`` configurations (template, network, disk size, snapshot)
            created, so that ``create`` takes a warm one in ~1 ms instead of booting one
            (~15 ms). Default: ``ROLLBOX_POOL_SIZE``, else 2; 0 turns the pool off.
    """

    MAX_POOLED_CONFIGS: ClassVar[int] = 4

    name: ClassVar[str] = "local"
    _live: ClassVar[weakref.WeakSet[LocalSandbox]] = weakref.WeakSet()

    def __init__(self, *, max_sandboxes: int | None = None, pool_size: int | None = None) -> None:
        if max_sandboxes is None:
            max_sandboxes = _int_from_env("ROLLBOX_MAX_SANDBOXES", 256)
        if pool_size is None:
            pool_size = _int_from_env("ROLLBOX_POOL_SIZE", 2)
        if max_sandboxes < 1:
            raise ConfigError("max_sandboxes must be at least 1")
        if pool_size < 0:
            raise ConfigError("pool_size must be 0 or more")
        self.max_sandboxes = max_sandboxes
        self.pool_size = pool_size
        self.cgroups = _host.require_cgroups()
        self.bwrap = _host.bwrap_path()
        if not _seccomp.supported():
            raise BackendUnavailableError(
                "rollbox's seccomp filter supports x86_64 and aarch64 only"
            )
        self.seccomp_program = _seccomp.build_filter()
        self.state_dir = self.state_path()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir.parent, 0o755)  # bwrap, as the sandbox user, binds files from it
        self._etc_dir = _python_etc(_host.state_dir())
        # named by its content: processes running different rollbox versions share the directory
        digest = hashlib.sha256(_AGENT_SOURCE).hexdigest()[:12]
        self._agent_path = self._write_shared(f"agent-{digest}.py", _AGENT_SOURCE)
        self._templates: dict[str, _Template] = {}
        self._live_here: weakref.WeakValueDictionary[str, LocalSandbox] = (
            weakref.WeakValueDictionary()
        )
        self._slots = SandboxSlots(max_sandboxes, "LocalProvider")
        self._pools: dict[tuple[Any, ...], deque[LocalSandbox]] = {}
        self._refills: set[asyncio.Task[None]] = set()
        self._retired: dict[Path, Path] = {}  # deleted snapshots still stacked by live forks
        self._closed = False
        self.reaped_at_start = self.cleanup()  # what crashed processes left behind
        _install_exit_hook()

    @staticmethod
    def state_path() -> Path:
        """The directory of live-sandbox records, one JSON file per sandbox."""
        return _host.state_dir() / "sandboxes"

    def _write_shared(self, name: str, data: bytes) -> Path:
        """A world-readable file in the state directory, for bwrap to bind read-only."""
        path = _host.state_dir() / name
        if not path.exists() or path.read_bytes() != data:
            _host.write_atomically(path, data, mode=0o644)
        return path

    def template(self, name: str) -> _Template:
        template = self._templates.get(name)
        if template is None:
            template = self._templates[name] = _Template(name)
        return template

    async def _template_for(self, spec: SandboxSpec) -> _Template:
        """The template of a spec; a Template definition is built (once) first."""
        if isinstance(spec.template, str):
            return self.template(spec.template)
        key = spec.template.model_dump_json(by_alias=True)
        template = self._templates.get(key)
        if template is None:
            built = await asyncio.to_thread(build_local, spec.template)
            template = self._templates[key] = _Template(spec.template.name, built)
        return template

    def bwrap_argv(
        self,
        template: _Template,
        disk_mb: int,
        pids_cgroup: Path,
        seccomp_fd: int,
        snapshot: Path | None = None,
    ) -> list[str]:
        size = str(disk_mb * 1024 * 1024)
        agent, agent_in_sandbox = template.agent(self._agent_path)
        if snapshot is None:
            writable = [
                "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
                "--perms", "0755", "--size", size, "--tmpfs", "/work",
            ]  # fmt: skip
        else:  # the snapshot's files under a writable layer (bounded by the memory cgroup)
            writable = [
                "--overlay-src", str(snapshot / "tmp"), "--tmp-overlay", "/tmp",
                "--overlay-src", str(snapshot / "work"), "--tmp-overlay", "/work",
            ]  # fmt: skip
        return [
            self.bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup", "--unshare-net",
            "--disable-userns", "--cap-drop", "ALL", "--as-pid-1", "--die-with-parent",
            "--new-session", "--clearenv", "--hostname", "sandbox",
            *template.root_args(self._etc_dir, snapshot),
            "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev",  # its tmpfs is writable and unbounded otherwise
            *writable,
            # /.rollbox is a read-only mount of its own: on a template with a writable root, a
            # plain directory there would let the agent plant /.rollbox/bin/python3 (first on
            # PATH) for every later command, the verifier's included.
            "--perms", "0755", "--size", "1048576", "--tmpfs", "/.rollbox",
            *template.helper_links(),
            "--bind", str(pids_cgroup), _CGROUP_IN_SANDBOX,
            "--ro-bind", str(agent), agent_in_sandbox,
            "--remount-ro", "/.rollbox",
            # the python template's root is bwrap's tmpfs: read-only. A root filesystem
            # template's root is its own writable overlay (bounded by the memory cgroup).
            *(["--remount-ro", "/"] if template.rootfs is None else []),
            "--chdir", "/work", "--setenv", "PATH", DEFAULT_PATH, "--setenv", "HOME", "/work",
            "--seccomp", str(seccomp_fd),
            "--", template.python, "-I", "-S", agent_in_sandbox, _CGROUP_IN_SANDBOX, size,
        ]  # fmt: skip

    # -- slots -----------------------------------------------------------------------------

    # -- create ----------------------------------------------------------------------------

    async def create(
        self, spec: SandboxSpec, *, wait_for_slot: bool = True, slot_timeout_seconds: float = 300.0
    ) -> LocalSandbox:
        if self._closed:
            raise SandboxStartError("this LocalProvider is closed")
        if spec.network.enabled:
            _netns.require(spec.network)  # root, ip and nft, a free address range
        template = await self._template_for(spec)
        snapshot = None
        if spec.snapshot is not None:
            snapshot = Path(spec.snapshot.ref)
            if not (snapshot / "work").is_dir():
                raise SandboxStartError(f"snapshot {spec.snapshot.id} was deleted")
        # Pool keys hold what _boot needs: the network, and a snapshot directory.
        key = (template.identity, spec.network, spec.limits.disk_mb, snapshot)
        await self._slots.take(wait_for_slot, slot_timeout_seconds)
        sandbox: LocalSandbox | None = None
        try:
            sandbox = self._take_pooled(key)
            if sandbox is None:
                sandbox = LocalSandbox(self, self._new_id(), key)
                self._register(sandbox)
                await sandbox._boot(template, spec.limits.disk_mb)
            await sandbox._activate(spec)
        except BaseException:  # cancelled (Ctrl-C, a client that left) or failed: leave nothing
            if sandbox is not None and sandbox.alive:
                sandbox._destroy_now()
            self._slots.release()
            raise
        sandbox._holds_slot = True
        if len(self._pools.get(key, ())) >= 2:
            # Warm ones are left: boot the replacement when this one is killed, rather than
            # now, when it would take CPU from this sandbox's first commands. (With one left,
            # now: a loop that creates back to back would soon find the pool empty.)
            sandbox._refill_when_killed = True
        else:
            self._schedule_refill(key, template, spec.limits.disk_mb)
        return sandbox

    def _new_id(self) -> str:
        return "sb-" + secrets.token_hex(6)

    def _register(self, sandbox: LocalSandbox) -> None:
        self._live_here[sandbox.id] = sandbox
        self._live.add(sandbox)

    def _take_pooled(self, key: tuple[Any, ...]) -> LocalSandbox | None:
        pool = self._pools.get(key)
        while pool:
            sandbox = pool.popleft()
            if sandbox.alive:
                return sandbox
        return None

    def _schedule_refill(self, key: tuple[Any, ...], template: _Template, disk_mb: int) -> None:
        if self.pool_size == 0 or self._closed:
            return
        pool = self._pools.pop(key, None)
        self._pools[key] = pool = deque() if pool is None else pool  # the latest used is last
        while len(self._pools) > self.MAX_POOLED_CONFIGS:
            stale = self._pools.pop(next(iter(self._pools)))  # a refill under way sees it gone
            for sandbox in stale:
                sandbox._background(sandbox.kill())
        missing = (
            self.pool_size - len(pool) - sum(1 for t in self._refills if t.get_name() == repr(key))
        )
        for _ in range(missing):
            task = asyncio.ensure_future(self._refill(key, template, disk_mb, pool))
            task.set_name(repr(key))
            self._refills.add(task)
            task.add_done_callback(self._refills.discard)

    async def _refill(
        self, key: tuple[Any, ...], template: _Template, disk_mb: int, pool: deque[LocalSandbox]
    ) -> None:
        sandbox = LocalSandbox(self, self._new_id(), key)
        self._register(sandbox)
        try:
            await sandbox._boot(template, disk_mb, ahead=True)
        except SandboxError:
            return
        except asyncio.CancelledError:  # close(), or its snapshot was deleted
            sandbox._destroy_now()
            raise
        if self._closed or self._pools.get(key) is not pool:  # closed, or the pool was dropped
            await sandbox.kill()
        else:
            pool.append(sandbox)

    # -- the rest of the contract ----------------------------------------------------------

    async def list(self) -> list[SandboxInfo]:
        return [s.info() for s in self._live_here.values() if s.alive and s._holds_slot]

    async def get(self, sandbox_id: str) -> LocalSandbox:
        sandbox = self._live_here.get(sandbox_id)
        if sandbox is None or not sandbox.alive or not sandbox._holds_slot:  # warm: no one's yet
            raise SandboxDeadError(
                f"no live sandbox {sandbox_id!r} in this provider", sandbox_id=sandbox_id
            )
        return sandbox

    async def delete_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.provider != "local":
            raise ConfigError(f"snapshot {snapshot.id} belongs to the {snapshot.provider} provider")
        directory = Path(snapshot.ref)
        trash = await asyncio.to_thread(_snapshots.retire, snapshot)
        if trash is None:
            return
        keys = [key for key in self._pools if directory in key]
        # Warm forks, and forks booting for the pool (a cancelled boot undoes its own work).
        refills = [t for t in self._refills if t.get_name() in {repr(key) for key in keys}]
        for task in refills:
            task.cancel()
        await asyncio.gather(*refills, return_exceptions=True)
        for key in keys:
            await asyncio.gather(*(s.kill() for s in self._pools.pop(key)))
        self._retired[directory] = trash
        await self._release_snapshot(directory)

    async def _release_snapshot(self, directory: Path) -> None:
        """Remove a deleted snapshot's files once no sandbox of this provider stacks them."""
        trash = self._retired.get(directory)
        users = [s for s in self._live_here.values() if s.alive and directory in s._pool_key]
        if trash is not None and not users:
            del self._retired[directory]
            await asyncio.to_thread(_snapshots.remove_directory, trash)

    async def close(self) -> None:
        self._closed = True
        refills = list(self._refills)
        for task in refills:
            task.cancel()
        await asyncio.gather(*refills, return_exceptions=True)  # a boot undoes its own work
        sandboxes = [s for s in self._live_here.values() if s.alive]
        await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)
        self._live_here.clear()
        self._pools.clear()
        for trash in self._retired.values():
            await asyncio.to_thread(_snapshots.remove_directory, trash)
        self._retired.clear()
        _netns.release_host_if_idle()

    def cleanup(self) -> int:
        """Reap sandboxes whose owning process died or whose TTL passed; returns how many."""
        reaped = 0
        now = time.time()
        known: set[str] = set()
        for path in sorted(self.state_dir.glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            known.add(record["id"])
            owner_alive = _host.process_start_time(record["owner_pid"]) == record.get("owner_start")
            expired = record.get("expires_at") is not None and now > record["expires_at"] + 5
            if owner_alive and not expired:
                continue
            cgroups = {k: Path(v) for k, v in record.get("cgroups", {}).items()}
            destroyed = _destroy(record.get("pid"), record.get("pid_start"), cgroups)
            if _netns.teardown(record.get("net")) and destroyed:
                with contextlib.suppress(OSError):
                    path.unlink()
                known.discard(record["id"])
                reaped += 1
        # Cgroups without a record are what a failed removal left. Only empty ones are removed:
        # one with processes may belong to a sandbox of another state directory, or to one
        # whose record was written after the scan above (records are written before cgroups).
        for parent in self.cgroups.parents.values():
            for child in parent.glob("sb-*"):
                if child.name in known or (self.state_dir / f"{child.name}.json").exists():
                    continue
                if _remove_cgroups({"orphan": child}):
                    reaped += 1
        # Network namespaces, veths, nft tables and leases whose record is gone.
        reaped += _netns.reap()
        reaped += _snapshots.reap()
        _netns.release_host_if_idle()
        return reaped

    def _kill_all_now(self) -> None:
        for sandbox in list(self._live_here.values()):
            if sandbox.alive:
                sandbox._destroy_now()


def _kill_everything_at_exit() -> None:
    for sandbox in list(LocalProvider._live):
        if sandbox.alive:
            with contextlib.suppress(Exception):
                sandbox._destroy_now()
    with contextlib.suppress(Exception):
        _netns.release_host_if_idle()


_exit_hook_installed = False


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if not _exit_hook_installed:
        atexit.register(_kill_everything_at_exit)
        _exit_hook_installed = True
