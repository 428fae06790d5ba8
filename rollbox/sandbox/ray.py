"""The Ray backend: sandboxes on the nodes of a Ray cluster, each run by that node's local backend.

``RayProvider`` starts one sandbox-host actor on every node (``RollboxSandboxHost``: a
``LocalProvider`` of that machine, driven by calls) and places each new sandbox on the node
with the most free capacity, i.e. the smallest share of its slots in use; a node has
``sandboxes_per_cpu`` slots per Ray CPU, so a node started with ``--num-cpus 0`` hosts none
unless it is named with ``RayProvider(node=...)``. A ``RaySandbox`` has the API of every other
sandbox: each primitive is a call to its host actor, and a command's output streams back
through a Ray streaming generator.

A sandbox lives in its host's worker process: bwrap runs with ``--die-with-parent`` under that
worker's spawner helper, which exits with the worker, so when the node or the worker dies, its
sandboxes die too, and the next rollbox process on that
machine reaps their cgroups and records. Callers then get ``SandboxDeadError`` with
``reason="node_died"``; ``create`` places the sandbox on another node, and ``run_rollouts``
runs the instances that were on the lost node again.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import os
import secrets
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollbox.errors import (
    BackendUnavailableError,
    CommandError,
    ConfigError,
    ProviderNotFoundError,
    RollboxError,
    SandboxDeadError,
    SandboxStartError,
    TooManySandboxesError,
)
from rollbox.sandbox.base import AsyncProcess, AsyncSandbox, FutureProcess, OutputCallback, Provider
from rollbox.sandbox.local import LocalProvider, LocalSandbox
from rollbox.sandbox.models import FileEntry, SandboxInfo, SandboxSpec, Snapshot

try:
    import ray
    from ray.exceptions import (
        NodeDiedError,
        ObjectLostError,
        RayActorError,
        RayError,
        RayTaskError,
        WorkerCrashedError,
    )
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ProviderNotFoundError(
        f"the ray provider needs Ray ({_exc}): pip install 'rollbox[ray]'"
    ) from _exc

# Ray's errors that mean the host actor, its worker process or its node is gone.
_HOST_GONE = (RayActorError, NodeDiedError, ObjectLostError, WorkerCrashedError)
_HOST_START_TIMEOUT = 120.0  # a worker process has to start and import rollbox
_REFRESH_SECONDS = 10.0  # how often create looks for nodes that joined or left
_STRAGGLER_SECONDS = 5.0  # how long the first create waits for more hosts than the first


class RollboxSandboxHost:
    """The sandbox host of one node: its LocalProvider, driven by a RayProvider's calls.

    Runs as an async Ray actor; every method takes the id of a sandbox it created.
    """

    def __init__(self, max_sandboxes: int) -> None:
        self._local: LocalProvider | None = None
        self._max_sandboxes = max_sandboxes
        # Strong references: the local backend kills a sandbox nobody holds.
        self._sandboxes: dict[str, LocalSandbox] = {}
        self._tokens: dict[str, str] = {}  # create token -> sandbox id
        self._abandoned: set[str] = set()  # tokens whose caller gave up before the answer
        self._processes: dict[int, AsyncProcess] = {}
        self._numbers = itertools.count(1)

    async def start(self) -> dict[str, Any]:
        """Start the node's LocalProvider (which reaps what earlier hosts left); where am I."""
        self._local = LocalProvider(max_sandboxes=self._max_sandboxes)
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "reaped": self._local.reaped_at_start,
        }

    async def watch(self) -> None:
        """Never returns: the caller learns of this host's death when this call fails."""
        await asyncio.Event().wait()

    def _get(self, sandbox_id: str) -> LocalSandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is not None and sandbox.alive:
            return sandbox
        if sandbox is not None:
            raise sandbox._dead_error()  # with its reason: ttl, oom, exited, killed
        raise SandboxDeadError(
            f"no live sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id
        )

    def _prune(self) -> None:
        for sandbox_id in [i for i, s in self._sandboxes.items() if not s.alive]:
            del self._sandboxes[sandbox_id]
        self._tokens = {t: i for t, i in self._tokens.items() if i in self._sandboxes}

    async def create(self, spec: SandboxSpec, token: str) -> SandboxInfo:
        assert self._local is not None
        self._prune()
        # The caller counts slots; the wait covers a kill it counted before this host finished it.
        sandbox = await self._local.create(spec, wait_for_slot=True, slot_timeout_seconds=60.0)
        if token in self._abandoned:
            self._abandoned.discard(token)
            await sandbox.kill()
            raise SandboxStartError("the caller gave up waiting for this sandbox")
        self._sandboxes[sandbox.id] = sandbox
        self._tokens[token] = sandbox.id
        return sandbox.info()

    async def abandon(self, token: str) -> None:
        """Kill what a cancelled ``create`` made, now or when it is made."""
        sandbox_id = self._tokens.pop(token, None)
        if sandbox_id is None:
            self._abandoned.add(token)
        else:
            await self.kill(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is not None:
            await sandbox.kill()

    async def kill_all(self, sandbox_id: str) -> None:
        await self._get(sandbox_id).commands.kill_all()

    async def exec(
        self,
        sandbox_id: str,
        command: str,
        cwd: str,
        env: dict[str, str],
        stdin: bytes | None,
        timeout_seconds: float | None,
        stream_stdout: bool,
        stream_stderr: bool,
    ) -> Any:
        """A streaming generator: ("started", number, pid), output events, ("exit", result)."""
        events: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        process = await self._get(sandbox_id)._spawn(
            command,
            cwd=cwd,
            env=env,
            stdin=stdin,
            timeout_seconds=timeout_seconds,
            on_stdout=(lambda data: events.put_nowait(("stdout", data))) if stream_stdout else None,
            on_stderr=(lambda data: events.put_nowait(("stderr", data))) if stream_stderr else None,
        )
        number = next(self._numbers)
        self._processes[number] = process
        try:
            yield ("started", number, process.pid)
            # Output is dispatched before the exit, so it is queued ahead of the "exit" marker.
            finished = asyncio.ensure_future(process.wait())
            finished.add_done_callback(lambda _: events.put_nowait(("exit", "")))
            while True:
                kind, data = await events.get()
                if kind == "exit":
                    yield ("exit", finished.result(), None)
                    return
                yield (kind, data, None)
        finally:
            self._processes.pop(number, None)

    async def kill_process(self, sandbox_id: str, number: int) -> None:
        process = self._processes.get(number)
        if process is not None:
            await process.kill()

    async def process_logs(self, sandbox_id: str, number: int) -> tuple[str, str] | None:
        process = self._processes.get(number)
        return None if process is None else await process.logs()

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        await self._get(sandbox_id)._write_file(path, data, mode)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._get(sandbox_id)._read_file(path)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return await self._get(sandbox_id)._list_dir(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._get(sandbox_id)._remove(path, recursive)

    async def snapshot(self, sandbox_id: str) -> Snapshot:
        return await self._get(sandbox_id).snapshot()

    async def delete_snapshot(self, snapshot: Snapshot) -> None:
        assert self._local is not None
        await self._local.delete_snapshot(snapshot)

    async def list(self) -> list[SandboxInfo]:
        assert self._local is not None
        return await self._local.list()

    async def close(self) -> None:
        """Kill every sandbox of this host and remove their cgroups and records."""
        if self._local is not None:
            await self._local.close()
        self._sandboxes.clear()


_HostActor = ray.remote(RollboxSandboxHost)


@dataclass(eq=False)
class _Host:
    """A RayProvider's view of one node's host actor."""

    node_id: str
    handle: Any
    capacity: int
    pid: int
    live: int = 0  # sandboxes this provider holds there (slots taken)
    lost: str | None = None
    sandboxes: weakref.WeakValueDictionary[str, RaySandbox] = field(
        default_factory=weakref.WeakValueDictionary
    )
    watcher: asyncio.Future[None] | None = None


def _why(exc: BaseException) -> str:
    """The first line of a Ray error, which says what happened."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _unwrap(exc: BaseException) -> BaseException:
    """The rollbox error a host raised (Ray wraps it in RayTaskError), else ``exc`` itself."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, RollboxError):
            return cause
        return RollboxError(f"the sandbox host failed: {cause!r}")
    if isinstance(exc, RayError):
        return BackendUnavailableError(f"Ray failed: {_why(exc)}")
    return exc


class RayProcess(FutureProcess):
    """A command running in a sandbox on a Ray node; its output arrives as a stream."""

    def __init__(
        self,
        sandbox: RaySandbox,
        stream: Any,
        number: int,
        pid: int,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> None:
        super().__init__()
        self._sandbox = sandbox
        self._number = number
        self.pid = pid
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._reader = asyncio.ensure_future(self._read(stream))
        sandbox._processes.add(self)
        self._reader.add_done_callback(lambda _: sandbox._processes.discard(self))

    async def _read(self, stream: Any) -> None:
        pending: set[asyncio.Future[Any]] = set()
        try:
            async for ref in stream:
                kind, data, _ = await ref
                if kind == "exit":
                    self._settle(result=data)
                    return
                callback = self._callbacks.get(kind)
                if callback is not None:
                    result = callback(data)
                    if asyncio.iscoroutine(result):
                        task = asyncio.ensure_future(result)
                        pending.add(task)
                        task.add_done_callback(pending.discard)
            self._settle(error=RollboxError("the command's output stream ended without its exit"))
        except asyncio.CancelledError:
            self._settle(error=self._sandbox._dead_error())
        except Exception as exc:
            self._settle(error=self._sandbox._failure(exc))

    async def kill(self) -> None:
        if self._done.done() or not self._sandbox.alive:
            return
        with contextlib.suppress(SandboxDeadError):
            await self._sandbox._call("kill_process", self._number)

    async def logs(self) -> tuple[str, str]:
        if not self._done.done():
            logs = await self._sandbox._call("process_logs", self._number)
            if logs is not None:
                return logs
        result = await self.wait()  # it ended on the host: its result is on its way
        return result.stdout, result.stderr


class RaySandbox(AsyncSandbox):
    """A sandbox on a node of a Ray cluster; ``node_id`` says which."""

    provider_name: ClassVar[str] = "ray"

    def __init__(
        self, provider: RayProvider, host: _Host, info: SandboxInfo, spec: SandboxSpec
    ) -> None:
        super().__init__()
        self.id = info.id
        self.spec = spec
        self.node_id = host.node_id
        self._provider = provider
        self._host = host
        self._info = info.model_copy(update={"provider": "ray"})
        self._death: tuple[str, str] | None = None  # (reason, what happened)
        self._processes: set[RayProcess] = set()
        self._ttl_handle: asyncio.TimerHandle | None = None
        if spec.ttl_seconds is not None:  # the host kills it then; `alive` must know it too
            self._ttl_handle = asyncio.get_running_loop().call_later(
                spec.ttl_seconds, _expire, weakref.ref(self)
            )

    @property
    def alive(self) -> bool:
        return self._death is None

    def info(self) -> SandboxInfo:
        return self._info

    def _dead_error(self) -> SandboxDeadError:
        reason, what = self._death or ("killed", "killed")
        return SandboxDeadError(
            f"sandbox {self.id} is dead: {what}", sandbox_id=self.id, reason=reason
        )

    def _mark_dead(self, reason: str, what: str) -> None:
        """Record the death once: fail its commands, give its slot back."""
        if self._death is not None:
            return
        self._death = (reason, what)
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
        error = self._dead_error()
        for process in list(self._processes):
            process._settle(error=error)
        self._provider._release(self._host)

    def _node_died(self, why: str) -> None:
        self._mark_dead(
            "node_died",
            f"its Ray node {self.node_id} (or the sandbox host there) was lost: {why}",
        )

    def _failure(self, exc: BaseException) -> BaseException:
        """The error a caller sees for a failed call to the host."""
        if isinstance(exc, _HOST_GONE):
            self._provider._lose(self._host, _why(exc))
            return self._dead_error()
        error = _unwrap(exc)
        if isinstance(error, SandboxDeadError):
            self._mark_dead(error.reason, str(error).split(" is dead: ", 1)[-1])
        return error

    def _check_alive(self) -> None:
        if self._death is not None:
            raise self._dead_error()

    async def _call(self, method: str, *args: Any) -> Any:
        self._check_alive()
        try:
            return await getattr(self._host.handle, method).remote(self.id, *args)
        except Exception as exc:
            raise self._failure(exc) from None

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
        stream = self._host.handle.exec.remote(
            self.id,
            command,
            cwd,
            env,
            stdin,
            timeout_seconds,
            on_stdout is not None,
            on_stderr is not None,
        )
        try:
            _, number, pid = await (await stream.__anext__())
        except StopAsyncIteration:
            raise CommandError(f"{self.id}: the host did not start the command") from None
        except Exception as exc:
            raise self._failure(exc) from None
        return RayProcess(self, stream, number, pid, on_stdout, on_stderr)

    async def _kill_all_processes(self) -> None:
        await self._call("kill_all")

    async def _write_file(self, path: str, data: bytes, mode: int) -> None:
        await self._call("write_file", path, data, mode)

    async def _read_file(self, path: str) -> bytes:
        return await self._call("read_file", path)

    async def _list_dir(self, path: str) -> list[FileEntry]:
        return await self._call("list_dir", path)

    async def _remove(self, path: str, recursive: bool) -> None:
        await self._call("remove", path, recursive)

    async def _snapshot(self) -> Snapshot:
        local: Snapshot = await self._call("snapshot")
        # The snapshot's files stay on this node: its sandboxes are placed here.
        return local.model_copy(update={"provider": "ray", "ref": f"{self.node_id}:{local.ref}"})

    async def kill(self) -> None:
        if self._death is not None:
            return
        self._mark_dead("killed", "killed")
        with contextlib.suppress(Exception):  # a lost node took the sandbox with it
            await self._host.handle.kill.remote(self.id)

    def _expire(self) -> None:
        self._mark_dead("ttl", f"its TTL of {self.spec.ttl_seconds}s ran out")

    def __del__(self) -> None:
        # Abandoned: its host still holds it, so kill it there (the local backend's GC rule).
        if getattr(self, "_death", True) is None:
            with contextlib.suppress(Exception):
                self._death = ("killed", "abandoned without kill")
                self._host.handle.kill.remote(self.id)
                self._provider._release_from_any_thread(self._host)


def _expire(sandbox_ref: weakref.ref[RaySandbox]) -> None:
    sandbox = sandbox_ref()
    if sandbox is not None:
        sandbox._expire()


class RayProvider(Provider):
    """Sandboxes on the nodes of a Ray cluster, each run by that node's local backend.

    Args:
        address: the cluster (``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``); default
            ``RAY_ADDRESS``, else a local Ray started for this process. If this process is
            already connected (``ray.init`` was called), that connection is used.
        node: place every sandbox on this node: a Ray node id, or a node's IP address.
        max_sandboxes: this provider's cap on live sandboxes; default the sum of the nodes'.
        sandboxes_per_cpu: slots per Ray CPU of a node.

    Every node needs rollbox installed (``pip install 'rollbox[ray]'``) and what the local
    backend needs (``rollbox doctor``). Templates named by a string must be built on every node.
    """

    name: ClassVar[str] = "ray"
    _open: ClassVar[weakref.WeakSet[RayProvider]] = weakref.WeakSet()

    def __init__(
        self,
        address: str | None = None,
        *,
        node: str | None = None,
        max_sandboxes: int | None = None,
        sandboxes_per_cpu: float = 8.0,
    ) -> None:
        if max_sandboxes is not None and max_sandboxes < 1:
            raise ConfigError("max_sandboxes must be at least 1")
        if not sandboxes_per_cpu > 0:
            raise ConfigError(f"sandboxes_per_cpu must be positive, got {sandboxes_per_cpu}")
        if node is not None and (not isinstance(node, str) or not node):
            raise ConfigError("node must be a Ray node id or a node's IP address")
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.node = node
        self.max_sandboxes = max_sandboxes
        self.sandboxes_per_cpu = sandboxes_per_cpu
        self._hosts: dict[str, _Host] = {}
        self._lost: dict[str, str] = {}  # node id -> why no sandbox goes there any more
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Lock | None = None
        self._starting: dict[str, asyncio.Future[None]] = {}  # node id -> its host's start
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- nodes and their hosts -------------------------------------------------------------

    async def _connect(self) -> None:
        if ray.is_initialized():
            _install_exit_hook()
            return
        try:
            await asyncio.to_thread(ray.init, address=self.address, ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = self.address or "RAY_ADDRESS / a new local instance"
            raise BackendUnavailableError(
                f"cannot connect to the Ray cluster at {where}: {exc} (start one with "
                "`ray start --head`, and pass its address)"
            ) from exc
        _install_exit_hook()  # after ray.init, so it runs before Ray's own exit hook

    def _matches(self, node: dict[str, Any]) -> bool:
        return self.node is None or self.node in (node["NodeID"], node["NodeManagerAddress"])

    async def _refresh(self, *, force: bool = False) -> None:
        """Start hosts on nodes that joined; drop those whose node Ray reports dead."""
        self._loop = asyncio.get_running_loop()
        if self._refreshing is None:
            self._refreshing = asyncio.Lock()
        async with self._refreshing:
            if not force and time.monotonic() - self._refreshed_at < _REFRESH_SECONDS:
                return
            await self._connect()
            nodes = {n["NodeID"]: n for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
            for node_id, host in list(self._hosts.items()):
                if node_id not in nodes:
                    self._lose(host, "Ray reports the node dead")
            for node_id, node in nodes.items():
                known = node_id in self._hosts or node_id in self._starting
                if known or node_id in self._lost or not self._matches(node):
                    continue
                cpus = float(node.get("Resources", {}).get("CPU", 0.0))
                if cpus <= 0 and self.node is None:
                    continue  # a node without CPUs runs nothing unless it is named
                capacity = max(1, int(max(cpus, 1.0) * self.sandboxes_per_cpu))
                task = asyncio.ensure_future(self._start_host(node_id, capacity))
                self._starting[node_id] = task
                task.add_done_callback(lambda _, node_id=node_id: self._starting.pop(node_id, None))
            self._refreshed_at = time.monotonic()
            if not self._hosts and self._starting:
                await self._first_hosts(list(self._starting.values()))

    async def _first_hosts(self, starting: list[asyncio.Future[None]]) -> None:
        """Wait for a first host, and give the others a few seconds to join it.

        Later hosts join in the background: a node that died but that Ray has not declared
        dead yet keeps its host's start pending, and must not hold up every ``create``.
        """
        pending = set(starting)
        while pending and not self._hosts:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            await asyncio.wait(pending, timeout=_STRAGGLER_SECONDS)

    async def _start_host(self, node_id: str, capacity: int) -> None:
        handle = _HostActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            num_cpus=0,  # it hosts sandboxes, which have their own cgroup limits
            max_concurrency=10_000,  # every running command holds one call
            max_restarts=0,  # a restarted host would not have the sandboxes
        ).remote(capacity)
        try:
            started = await asyncio.wait_for(_awaitable(handle.start.remote()), _HOST_START_TIMEOUT)
        except asyncio.CancelledError:  # the provider was closed
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
            raise
        except Exception as exc:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
            error = _unwrap(exc)
            self._lost[node_id] = f"its sandbox host did not start: {_why(error)}"
            return
        host = _Host(node_id=node_id, handle=handle, capacity=capacity, pid=started["pid"])
        host.watcher = asyncio.ensure_future(self._watch(host))
        self._hosts[node_id] = host
        self._wake()  # a create waiting for a slot may take one here

    async def _watch(self, host: _Host) -> None:
        try:
            await host.handle.watch.remote()
        except asyncio.CancelledError:
            return
        except Exception as exc:
            if not self._closed:
                self._lose(host, _why(exc))

    def _lose(self, host: _Host, why: str) -> None:
        """A host (or its node) is gone: its sandboxes are dead, and no new one goes there."""
        if host.lost is not None:
            return
        host.lost = why
        if self._hosts.get(host.node_id) is host:
            del self._hosts[host.node_id]
        self._lost[host.node_id] = why
        if host.watcher is not None and host.watcher is not asyncio.current_task():
            host.watcher.cancel()
        for sandbox in list(host.sandboxes.values()):
            sandbox._node_died(why)
        with contextlib.suppress(Exception):  # if it comes back, it must not keep sandboxes
            ray.kill(host.handle, no_restart=True)
        self._wake()

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The nodes this provider places sandboxes on: capacity, live sandboxes, host pid."""
        return {
            h.node_id: {"capacity": h.capacity, "live": h.live, "host_pid": h.pid}
            for h in self._hosts.values()
        }

    # -- slots -----------------------------------------------------------------------------

    def _pick(self) -> _Host | None:
        """The host with the most free capacity (smallest share of its slots in use)."""
        hosts = list(self._hosts.values())
        if self.max_sandboxes is not None and sum(h.live for h in hosts) >= self.max_sandboxes:
            return None
        free = [h for h in hosts if h.live < h.capacity]
        return min(free, key=lambda h: (h.live / h.capacity, h.live), default=None)

    def _release(self, host: _Host) -> None:
        host.live -= 1
        self._wake()

    def _release_from_any_thread(self, host: _Host) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._release, host)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _no_host_error(self) -> RollboxError:
        if self.node is not None:
            named = [n["NodeID"] for n in ray.nodes() if self._matches(n)]
            lost = [f"{n}: {self._lost[n]}" for n in named if n in self._lost]
            if lost:
                return SandboxStartError(
                    f"node {self.node} cannot host sandboxes: {'; '.join(lost)}"
                )
            alive = [
                f"{n['NodeID']} ({n['NodeManagerAddress']})" for n in ray.nodes() if n["Alive"]
            ]
            return ConfigError(
                f"RayProvider(node={self.node!r}) names no live node of the Ray cluster; "
                f"its nodes: {', '.join(alive) or 'none'}"
            )
        detail = "; ".join(f"{n}: {why}" for n, why in self._lost.items())
        return BackendUnavailableError(
            "no node of the Ray cluster can host sandboxes (a node needs CPUs, rollbox and "
            f"what `rollbox doctor` checks){': ' + detail if detail else ''}"
        )

    # -- the provider contract -------------------------------------------------------------

    async def create(
        self, spec: SandboxSpec, *, wait_for_slot: bool = True, slot_timeout_seconds: float = 300.0
    ) -> RaySandbox:
        if self._closed:
            raise SandboxStartError("this RayProvider is closed")
        RayProvider._open.add(self)
        pinned, local_spec = self._snapshot_placement(spec)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + slot_timeout_seconds
        while True:
            await self._refresh()
            if self._closed:
                raise SandboxStartError("this RayProvider is closed")
            if pinned is not None and pinned not in self._hosts:
                raise SandboxStartError(
                    f"snapshot {spec.snapshot.id if spec.snapshot else ''} is on node {pinned}, "
                    f"which is gone: {self._lost.get(pinned, 'not a node of this provider')}"
                )
            if not self._hosts:
                await self._refresh(force=True)
                if not self._hosts:
                    raise self._no_host_error()
            host = self._hosts[pinned] if pinned is not None else self._pick()
            if host is not None and pinned is not None and host.live >= host.capacity:
                host = None
            if host is None:
                remaining = deadline - loop.time()
                if not wait_for_slot or remaining <= 0:
                    raise TooManySandboxesError(
                        f"every slot of this RayProvider is taken ({self._slots_text()}); kill "
                        "some, raise max_sandboxes / sandboxes_per_cpu, or add nodes"
                    )
                waiter = loop.create_future()
                self._waiters.append(waiter)
                try:  # woken by a freed slot or a new node; else look for new nodes now and then
                    await asyncio.wait_for(waiter, min(remaining, _REFRESH_SECONDS))
                except TimeoutError:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                continue
            host.live += 1
            token = secrets.token_hex(8)
            try:
                info = await host.handle.create.remote(local_spec, token)
            except asyncio.CancelledError:
                self._release(host)
                with contextlib.suppress(Exception):
                    host.handle.abandon.remote(token)
                raise
            except Exception as exc:
                self._release(host)
                if isinstance(exc, _HOST_GONE):
                    self._lose(host, _why(exc))
                    if pinned is None:
                        continue  # placed on another node
                    raise SandboxStartError(
                        f"node {host.node_id} was lost while starting a sandbox: {_why(exc)}"
                    ) from None
                raise _unwrap(exc) from None
            sandbox = RaySandbox(self, host, info, spec)
            host.sandboxes[sandbox.id] = sandbox
            return sandbox

    def _slots_text(self) -> str:
        used = sum(h.live for h in self._hosts.values())
        total = sum(h.capacity for h in self._hosts.values())
        cap = f", max_sandboxes={self.max_sandboxes}" if self.max_sandboxes else ""
        return f"{used} of {total} on {len(self._hosts)} nodes{cap}"

    def _snapshot_placement(self, spec: SandboxSpec) -> tuple[str | None, SandboxSpec]:
        """A snapshot's sandboxes go to the node that holds its files, as a local snapshot."""
        if spec.snapshot is None:
            return None, spec
        node_id, _, ref = spec.snapshot.ref.partition(":")
        if spec.snapshot.provider != "ray" or not ref:
            raise ConfigError(f"snapshot {spec.snapshot.id} was not made by the ray provider")
        local = spec.snapshot.model_copy(update={"provider": "local", "ref": ref})
        return node_id, spec.model_copy(update={"snapshot": local})

    async def delete_snapshot(self, snapshot: Snapshot) -> None:
        node_id, _, ref = snapshot.ref.partition(":")
        if snapshot.provider != "ray" or not ref:
            raise ConfigError(f"snapshot {snapshot.id} belongs to the {snapshot.provider} provider")
        host = self._hosts.get(node_id)
        if host is None:
            return  # its node (or host) is gone, and its files with it
        local = snapshot.model_copy(update={"provider": "local", "ref": ref})
        try:
            await host.handle.delete_snapshot.remote(local)
        except _HOST_GONE as exc:
            self._lose(host, _why(exc))
        except Exception as exc:
            raise _unwrap(exc) from None

    async def list(self) -> list[SandboxInfo]:
        hosts = list(self._hosts.values())
        answers = await asyncio.gather(
            *(h.handle.list.remote() for h in hosts), return_exceptions=True
        )
        infos: list[SandboxInfo] = []
        for host, answer in zip(hosts, answers, strict=True):
            if isinstance(answer, _HOST_GONE):
                self._lose(host, _why(answer))
            elif isinstance(answer, BaseException):
                raise _unwrap(answer)
            else:
                infos += [i.model_copy(update={"provider": "ray"}) for i in answer]
        return infos

    async def get(self, sandbox_id: str) -> RaySandbox:
        for host in self._hosts.values():
            sandbox = host.sandboxes.get(sandbox_id)
            if sandbox is not None and sandbox.alive:
                return sandbox
        raise SandboxDeadError(
            f"no live sandbox {sandbox_id!r} in this provider", sandbox_id=sandbox_id
        )

    async def close(self) -> None:
        """Kill every sandbox of this provider, then its host actors."""
        self._closed = True
        RayProvider._open.discard(self)
        starting = list(self._starting.values())
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        hosts = list(self._hosts.values())
        self._hosts.clear()
        for host in hosts:
            if host.watcher is not None:
                host.watcher.cancel()
            for sandbox in list(host.sandboxes.values()):
                sandbox._mark_dead("killed", "its provider was closed")
        if hosts:
            await asyncio.wait(
                [asyncio.ensure_future(_awaitable(h.handle.close.remote())) for h in hosts],
                timeout=30,
            )
        for host in hosts:
            with contextlib.suppress(Exception):
                ray.kill(host.handle, no_restart=True)
        self._wake()

    def _close_now(self) -> None:
        """``close`` without an event loop, for the exit hook."""
        self._closed = True
        hosts = list(self._hosts.values())
        self._hosts.clear()
        with contextlib.suppress(Exception):
            ray.wait([h.handle.close.remote() for h in hosts], num_returns=len(hosts), timeout=30)
        for host in hosts:
            with contextlib.suppress(Exception):
                ray.kill(host.handle, no_restart=True)


async def _awaitable(ref: Any) -> Any:
    return await ref


_exit_hook_installed = False


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if not _exit_hook_installed:
        atexit.register(_close_all_at_exit)
        _exit_hook_installed = True


def _close_all_at_exit() -> None:
    """Hosts die with this process anyway; closing them first also removes their cgroups."""
    if not ray.is_initialized():
        return
    for provider in list(RayProvider._open):
        with contextlib.suppress(Exception):
            provider._close_now()


__all__ = ["RayProcess", "RayProvider", "RaySandbox", "RollboxSandboxHost"]
