"""The Docker backend: one container per sandbox, with rollbox's agent as its PID 1.

The Engine is found the standard way (``DOCKER_HOST``, else ``/var/run/docker.sock``) and spoken
to with httpx, a core dependency, over its unix socket (or plain ``tcp://``). A client library
would add aiohttp and its dependencies for a dozen JSON calls; the one thing httpx cannot do,
the bidirectional attach stream, is a 30-line HTTP upgrade here (:meth:`DockerClient.attach`).

A sandbox is a container of the template's image that runs ``python3 -I -S -c <agent>`` as PID 1
(so images need ``python3``, as the local backend's root filesystems do), as uid 65534 with
every capability dropped, ``no-new-privileges``, no network, memory (swap included), pids and CPU
limits, ``/work`` and ``/tmp`` as tmpfs of ``Limits.disk_mb`` (RLIMIT_FSIZE caps any one file)
and, with ``read_only_root=True``, a read-only root. The agent speaks rollbox's framed protocol
over the container's attached stdin/stdout (the same requests as the local backend:
``_agent_client.py``). Its stdin is attached once (``StdinOnce``): when rollbox goes away, even
by ``kill -9``, the connection closes, the agent exits and the container (``AutoRemove``) with
it. Labels on every container and image (``rollbox.sandbox``, ``rollbox.owner``,
``rollbox.expires``, ``rollbox.snapshot``) let :meth:`DockerProvider.cleanup` find what a
crashed process left.

Files go through the agent, not the Engine's archive endpoints: ``PUT/GET
/containers/{id}/archive`` do not see tmpfs mounts (a file PUT under ``/work`` lands in the
image layer hidden beneath the tmpfs, and reading it back fails; measured on Docker 20.10) and
refuse a read-only root. The agent resolves every path inside the container, so links made by
sandboxed code never reach a host file. Timeouts kill a command's whole process tree, setsid'd
orphans included: without a cgroup of its own, the agent runs each command under a subreaper
(see ``_agent.py``).

Snapshots commit the container (its root layer) and add the agent's capture of ``/work`` and
``/tmp`` (tmpfs, which a commit does not see) as a layer; a sandbox started from the snapshot
copies them back into its own tmpfs.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import io
import json
import os
import secrets
import socket
import tarfile
import tempfile
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

import httpx

from rollbox.errors import (
    BackendUnavailableError,
    ConfigError,
    SandboxDeadError,
    SandboxStartError,
    TemplateBuildError,
)
from rollbox.sandbox import _host
from rollbox.sandbox._agent_client import AgentSandbox, read_agent
from rollbox.sandbox.base import Provider, SandboxSlots
from rollbox.sandbox.models import SandboxInfo, SandboxSpec, Snapshot
from rollbox.sandbox.templates import (
    BuildLog,
    Template,
    base_rootfs,
    check_steps_fit_base,
    debian_suite,
    describe,
    docker_build_context,
    host_python_fingerprint,
    short,
    write_rootfs_tar,
)

_AGENT_SOURCE = Path(__file__).with_name("_agent.py").read_text()
_START_TIMEOUT = 30.0
_SANDBOX_USER = f"{_host.SANDBOX_UID}:{_host.SANDBOX_UID}"
_LABEL = "rollbox.sandbox"
_SNAPSHOT_LABEL = "rollbox.snapshot"
_TEMPLATE_LABEL = "rollbox.template"
_DEFAULT_SOCKET = "unix:///var/run/docker.sock"
_RESTORE = (  # run as the sandbox user: a snapshot's /work and /tmp back into the tmpfs mounts
    "import os, shutil, sys\n"
    "for top in ('work', 'tmp'):\n"
    "    source = sys.argv[1] + '/' + top\n"
    "    for name in os.listdir(source):\n"
    "        old, new = source + '/' + name, '/' + top + '/' + name\n"
    "        if os.path.isdir(old) and not os.path.islink(old):\n"
    "            shutil.copytree(old, new, symlinks=True, dirs_exist_ok=True)\n"
    "        else:\n"
    "            shutil.copy2(old, new, follow_symlinks=False)\n"
)
# The agent's source travels in the environment: a command line of 40 kB would fill every `ps`.
_AGENT_BOOT = "import os; exec(os.environ.pop('ROLLBOX_AGENT'))"


class DockerEngineError(BackendUnavailableError):
    """The Docker Engine refused a request or cannot be reached; ``status`` is its HTTP code."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class DockerClient:
    """The few Engine API calls rollbox makes, async (and sync for exit-time cleanup)."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or os.environ.get("DOCKER_HOST") or _DEFAULT_SOCKET
        self.socket_path: str | None = None
        self.address: tuple[str, int] | None = None
        if self.host.startswith("unix://"):
            self.socket_path = self.host.removeprefix("unix://")
            self.base_url = "http://docker"
        elif self.host.startswith(("tcp://", "http://")):
            if os.environ.get("DOCKER_TLS_VERIFY"):
                raise BackendUnavailableError(
                    "DOCKER_TLS_VERIFY is set: rollbox speaks to Docker over a unix socket or "
                    "plain tcp:// only; use the local socket (unix://) or an SSH tunnel to it"
                )
            parts = urlsplit(self.host)
            self.address = (parts.hostname or "127.0.0.1", parts.port or 2375)
            self.base_url = f"http://{self.address[0]}:{self.address[1]}"
        else:
            raise BackendUnavailableError(
                f"DOCKER_HOST={self.host!r}: rollbox supports unix:// and tcp:// Docker hosts"
            )
        self._client: httpx.AsyncClient | None = None
        self._sync: httpx.Client | None = None

    def _transport_args(self) -> dict[str, Any]:
        return {"uds": self.socket_path} if self.socket_path else {}

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(**self._transport_args()),
                base_url=self.base_url,
                timeout=httpx.Timeout(120.0, connect=10.0),
            )
        return self._client

    def sync_client(self) -> httpx.Client:
        if self._sync is None:
            self._sync = httpx.Client(
                transport=httpx.HTTPTransport(**self._transport_args()),
                base_url=self.base_url,
                timeout=httpx.Timeout(30.0, connect=5.0),
            )
        return self._sync

    def _unreachable(self, exc: Exception) -> DockerEngineError:
        return DockerEngineError(
            f"no Docker Engine answers at {self.host} ({exc}): start dockerd, or set DOCKER_HOST "
            "to its socket (e.g. unix:///run/docker.sock)"
        )

    @staticmethod
    def _check(response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code < 400:
            return response
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        raise DockerEngineError(f"{what}: {message.strip()}", status=response.status_code)

    async def call(
        self, method: str, path: str, *, what: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One request; a refusal raises DockerEngineError with the Engine's message."""
        try:
            response = await self.client.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError) as exc:
            raise self._unreachable(exc) from exc
        return self._check(response, what or f"{method} {path}")

    def sync_call(
        self, method: str, path: str, *, what: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        try:
            response = self.sync_client().request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError) as exc:
            raise self._unreachable(exc) from exc
        return self._check(response, what or f"{method} {path}")

    async def progress(
        self, method: str, path: str, *, what: str, log: BuildLog, **kwargs: Any
    ) -> list[dict[str, Any]]:
        """A request that answers with JSON progress lines (build, import, pull)."""
        messages: list[dict[str, Any]] = []
        try:
            async with self.client.stream(method, path, timeout=None, **kwargs) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._check(response, what)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    try:
                        message = json.loads(line)
                    except ValueError:
                        continue
                    messages.append(message)
                    text = message.get("stream") or message.get("status") or ""
                    for part in text.rstrip("\n").splitlines():
                        log(part)
        except (httpx.ConnectError, FileNotFoundError) as exc:
            raise self._unreachable(exc) from exc
        return messages

    async def attach(self, container_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The container's stdin and (multiplexed) stdout/stderr, as one upgraded connection."""
        try:
            if self.socket_path:
                reader, writer = await asyncio.open_unix_connection(self.socket_path, limit=1 << 24)
            else:
                assert self.address is not None
                reader, writer = await asyncio.open_connection(*self.address, limit=1 << 24)
        except OSError as exc:
            raise self._unreachable(exc) from exc
        request = (
            f"POST /containers/{container_id}/attach?stream=1&stdin=1&stdout=1&stderr=1 HTTP/1.1\r\n"
            "Host: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: 0\r\n\r\n"
        )
        writer.write(request.encode())
        await writer.drain()
        status = await reader.readline()
        while await reader.readline() not in (b"\r\n", b"\n", b""):
            pass
        parts = status.split()
        if len(parts) < 2 or parts[1] not in (b"101", b"200"):
            writer.close()
            raise DockerEngineError(f"attach to {container_id[:12]} refused: {status!r}")
        return reader, writer

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class _Demux:
    """The agent's stdout out of Docker's multiplexed attach stream; stderr is kept as a tail."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = bytearray()
        self.stderr_tail = bytearray()

    async def readexactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            header = await self._reader.readexactly(8)
            size = int.from_bytes(header[4:8], "big")
            data = await self._reader.readexactly(size) if size else b""
            if header[0] == 2:
                self.stderr_tail += data
                del self.stderr_tail[:-4096]
            else:
                self._buffer += data
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data


@dataclass
class _Image:
    """What a sandbox starts from: an image, its identity, and the environment it sets."""

    id: str
    template: str
    template_id: str
    env: dict[str, str] = field(default_factory=dict)
    restore_from: str | None = None  # where a snapshot image keeps /work and /tmp


def _owner() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_host.process_start_time(pid)}"


def _owner_gone(owner: str | None) -> bool:
    """Whether the process that labelled something (on this host) has exited."""
    if not owner:
        return True
    host, _, rest = owner.partition(":")
    pid_text, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False  # another machine's: its own cleanup, or its TTL, removes it
    return str(_host.process_start_time(int(pid_text))) != start


def _filters(**labels: str | None) -> str:
    return json.dumps({"label": [k if v is None else f"{k}={v}" for k, v in labels.items()]})


class DockerSandbox(AgentSandbox):
    """A sandbox of the Docker backend: one container."""

    provider_name: ClassVar[str] = "docker"

    def __init__(self, provider: DockerProvider, sandbox_id: str) -> None:
        super().__init__()
        self.id = sandbox_id
        self._provider = provider
        self.container_id: str | None = None
        self._image: _Image | None = None
        self._connection: asyncio.StreamWriter | None = None
        self._demux: _Demux | None = None
        self._reader: asyncio.Task[None] | None = None
        self._created_at = datetime.now(UTC)
        self._expires_at: datetime | None = None
        self._holds_slot = False
        self._owner_pid = os.getpid()

    def _container_config(self, spec: SandboxSpec, image: _Image) -> dict[str, Any]:
        limits = spec.limits
        disk = limits.disk_mb * 1024 * 1024
        memory = limits.memory_mb * 1024 * 1024
        labels = {
            _LABEL: self.id,
            "rollbox.owner": self._provider.owner,
            "rollbox.template": spec.template
            if isinstance(spec.template, str)
            else spec.template.name,
            "rollbox.template_id": image.template_id,
        }
        if spec.name:
            labels["rollbox.name"] = spec.name
        if self._expires_at is not None:
            labels["rollbox.expires"] = str(self._expires_at.timestamp())
        return {
            "Image": image.id,
            "Entrypoint": [],
            "Cmd": ["python3", "-I", "-S", "-c", _AGENT_BOOT, "-"],
            "Env": [f"ROLLBOX_AGENT={_AGENT_SOURCE}"],
            "User": _SANDBOX_USER,
            "WorkingDir": "/",
            "Hostname": "sandbox",
            "OpenStdin": True,
            "StdinOnce": True,
            "AttachStdin": True,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
            "NetworkDisabled": True,
            "Labels": labels,
            "HostConfig": {
                "AutoRemove": True,
                "NetworkMode": "none",
                "Memory": memory,
                "MemorySwap": memory,
                "PidsLimit": limits.pids,
                "NanoCpus": int(limits.cpus * 1e9),
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "ReadonlyRootfs": self._provider.read_only_root,
                "ShmSize": disk,
                "Tmpfs": {
                    "/work": f"rw,exec,nosuid,nodev,size={disk},mode=0755,"
                    f"uid={_host.SANDBOX_UID},gid={_host.SANDBOX_UID}",
                    "/tmp": f"rw,exec,nosuid,nodev,size={disk},mode=1777",
                },
                "Ulimits": [
                    {"Name": "fsize", "Soft": disk, "Hard": disk},
                    {"Name": "core", "Soft": 0, "Hard": 0},
                ],
            },
        }

    async def _boot(self, spec: SandboxSpec, image: _Image) -> None:
        """Create and start the container and wait for its agent; SandboxStartError if not."""
        self.spec = spec
        self._image = image
        self._template_env = image.env
        self._created_at = datetime.now(UTC)
        if spec.ttl_seconds is not None:
            self._expires_at = self._created_at + timedelta(seconds=spec.ttl_seconds)
        client = self._provider.client
        try:
            created = await client.call(
                "POST",
                "/containers/create",
                params={"name": f"rollbox-{self.id}"},
                json=self._container_config(spec, image),
                what=f"create the container of {self.id}",
            )
            self.container_id = created.json()["Id"]
            reader, self._connection = await client.attach(self.container_id)
            self._writer = self._connection
            self._demux = _Demux(reader)
            self._reader = asyncio.ensure_future(read_agent(weakref.ref(self), self._demux))
            await client.call(
                "POST", f"/containers/{self.container_id}/start", what=f"start {self.id}"
            )
            await asyncio.wait_for(asyncio.shield(self._ready), _START_TIMEOUT)
        except (DockerEngineError, TimeoutError, SandboxDeadError) as exc:
            tail = self._demux.stderr_tail if self._demux is not None else b""
            detail = bytes(tail).decode(errors="replace").strip()
            await self.kill()
            hint = " (the image needs python3 for rollbox's agent)" if "python3" in detail else ""
            raise SandboxStartError(
                f"sandbox {self.id} did not start: {detail or exc or 'timed out'}{hint}",
                sandbox_id=self.id,
            ) from exc
        except BaseException:
            await asyncio.shield(self.kill())
            raise
        if spec.ttl_seconds is not None:
            self._send({"op": "ttl", "seconds": spec.ttl_seconds})  # its reply is not awaited
            self._ttl_handle = asyncio.get_running_loop().call_later(
                spec.ttl_seconds, _expire, weakref.ref(self)
            )
        if image.restore_from:
            restored = await self.commands.run(
                f"python3 -I -S -c {_shell_quote(_RESTORE)} {image.restore_from}",
                cwd="/",
                timeout_seconds=600,
            )
            if not restored.ok:
                await self.kill()
                raise SandboxStartError(
                    f"sandbox {self.id} could not restore its snapshot's files: {restored.stderr}",
                    sandbox_id=self.id,
                )

    async def kill(self) -> None:
        if self._dead:
            return
        self._mark_dead()
        if self._connection is not None:
            self._connection.close()  # the agent sees EOF and exits, whatever happens below
        if self.container_id is not None and os.getpid() == self._owner_pid:
            with contextlib.suppress(DockerEngineError):
                await self._provider._remove_container(self.container_id)
            if self._image is not None and self._image.id in self._provider._deleted_snapshots:
                with contextlib.suppress(DockerEngineError):
                    await self._provider._remove_snapshot_image(self._image.id)
        if self._reader is not None:
            self._reader.cancel()
        self._release_slot()

    def _release_slot(self) -> None:
        if self._holds_slot:
            self._holds_slot = False
            self._provider._slots.release()

    def _destroy_now(self) -> None:
        """Synchronous teardown, for exit and the garbage collector."""
        self._dead = True
        if os.getpid() != self._owner_pid:
            return  # a forked child's copy: the container belongs to the parent
        if self.container_id is not None:
            with contextlib.suppress(Exception):
                self._provider._remove_container_now(self.container_id)
        self._release_slot()

    def __del__(self) -> None:
        if not getattr(self, "_dead", True):
            with contextlib.suppress(Exception):
                self._destroy_now()

    async def _snapshot(self) -> Snapshot:
        client = self._provider.client
        snapshot_id = "snap-" + secrets.token_hex(6)
        keep = f"/.rollbox/snapshots/{snapshot_id}"
        with tempfile.SpooledTemporaryFile(max_size=64 << 20) as spool:
            await self._capture(["/work", "/tmp"], spool.write)
            size = _file_bytes(spool)
            spool.seek(0)
            committed = await client.call(
                "POST",
                "/commit",
                params={"container": self.container_id, "pause": "true"},
                json={},
                what=f"commit {self.id}",
            )
            parent = committed.json()["Id"]
            labels = {
                _SNAPSHOT_LABEL: snapshot_id,
                "rollbox.owner": self._provider.owner,
                "rollbox.restore": keep,
            }
            dockerfile = f"FROM {parent}\nADD files.tar {keep}/\n".encode()
            context = io.BytesIO()
            with tarfile.open(fileobj=context, mode="w") as tar:
                info = tarfile.TarInfo("Dockerfile")
                info.size = len(dockerfile)
                tar.addfile(info, io.BytesIO(dockerfile))
                info = tarfile.TarInfo("files.tar")
                spool.seek(0, os.SEEK_END)
                info.size = spool.tell()
                spool.seek(0)
                tar.addfile(info, spool)
        image_id = await self._provider._build(
            context.getvalue(),
            labels,
            tag=None,
            what=f"snapshot of {self.id}",
            log=lambda line: None,
        )
        with contextlib.suppress(DockerEngineError):  # untagged: kept only as the parent
            await client.call("DELETE", f"/images/{parent}", params={"noprune": "1"})
        self._provider._snapshots_made.add(image_id)
        return Snapshot(
            id=snapshot_id,
            provider="docker",
            template=self.spec.template,
            template_id=self.template_id,
            source_sandbox=self.id,
            created_at=datetime.now(UTC),
            size_bytes=size,
            ref=image_id,
        )

    def info(self) -> SandboxInfo:
        template = self.spec.template
        return SandboxInfo(
            id=self.id,
            name=self.spec.name,
            provider="docker",
            template=template if isinstance(template, str) else template.name,
            template_id=self._image.template_id if self._image else "",
            created_at=self._created_at,
            expires_at=self._expires_at,
            snapshot=self.spec.snapshot.id if self.spec.snapshot else None,
        )


def _file_bytes(spool: Any) -> int:
    """File data bytes in a capture tar (what a snapshot holds)."""
    spool.seek(0)
    total = 0
    with tarfile.open(fileobj=spool, mode="r|") as tar:
        for member in tar:
            if member.isreg():
                total += member.size
    return total


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _expire(sandbox_ref: weakref.ref[DockerSandbox]) -> None:
    sandbox = sandbox_ref()
    if sandbox is not None:
        sandbox._expire()


class DockerProvider(Provider):
    """Sandboxes as Docker containers on a Docker Engine.

    Args:
        host: the Engine's address; default ``DOCKER_HOST``, else ``unix:///var/run/docker.sock``.
        max_sandboxes: cap on live sandboxes; past it ``create`` waits for a slot.
        read_only_root: mount every container's root read-only (``/work``, ``/tmp`` stay
            writable).

    Raises:
        DockerEngineError: no Engine answers at ``host``.
    """

    name: ClassVar[str] = "docker"
    _live: ClassVar[weakref.WeakSet[DockerSandbox]] = weakref.WeakSet()

    def __init__(
        self,
        *,
        host: str | None = None,
        max_sandboxes: int | None = None,
        read_only_root: bool = False,
    ) -> None:
        if max_sandboxes is None:
            max_sandboxes = int(os.environ.get("ROLLBOX_MAX_SANDBOXES", "256"))
        if max_sandboxes < 1:
            raise ConfigError("max_sandboxes must be at least 1")
        self.client = DockerClient(host)
        self.read_only_root = read_only_root
        self.engine_version = self.client.sync_call("GET", "/version").json().get("Version", "?")
        self.owner = _owner()
        self._pid = os.getpid()
        self._slots = SandboxSlots(max_sandboxes, "DockerProvider")
        self._images: dict[str, _Image] = {}
        self._image_locks: dict[str, asyncio.Lock] = {}
        self._live_here: weakref.WeakValueDictionary[str, DockerSandbox] = (
            weakref.WeakValueDictionary()
        )
        self._snapshots_made: set[str] = set()
        self._deleted_snapshots: set[str] = set()  # images to remove once their sandboxes end
        self._closed = False
        self.reaped_at_start = self.cleanup()
        _providers.add(self)
        _install_exit_hook()

    @property
    def max_sandboxes(self) -> int:
        return self._slots.limit

    # -- images ----------------------------------------------------------------------------

    async def _inspect_image(self, reference: str) -> dict[str, Any] | None:
        try:
            response = await self.client.call("GET", f"/images/{quote(reference, safe='')}/json")
        except DockerEngineError as exc:
            if exc.status == 404:
                return None
            raise
        return response.json()

    async def _image_for(self, spec: SandboxSpec) -> _Image:
        """The image of a spec's snapshot or template, built or imported once."""
        if spec.snapshot is not None:
            inspected = None
            if spec.snapshot.ref not in self._deleted_snapshots:
                inspected = await self._inspect_image(spec.snapshot.ref)
            if inspected is None:
                raise SandboxStartError(f"snapshot {spec.snapshot.id} was deleted")
            labels = (inspected.get("Config") or {}).get("Labels") or {}
            return _Image(
                id=inspected["Id"],
                template=spec.snapshot.template
                if isinstance(spec.snapshot.template, str)
                else spec.snapshot.template.name,
                template_id=spec.snapshot.template_id,
                env=_image_env(inspected),
                restore_from=labels.get("rollbox.restore"),
            )
        template = spec.template
        key = template if isinstance(template, str) else template.model_dump_json(by_alias=True)
        image = self._images.get(key)
        if image is not None:
            return image
        lock = self._image_locks.setdefault(key, asyncio.Lock())
        async with lock:
            image = self._images.get(key)
            if image is None:
                if isinstance(template, Template):
                    image = await self.build_template(template)
                else:
                    image = await self._named_image(template)
                self._images[key] = image
        return image

    async def _named_image(self, name: str) -> _Image:
        if name == "python":
            return await self._base_image("python", lambda line: None)
        built = await self.find_template(name)
        if built is not None:
            return built
        inspected = await self._inspect_image(name)
        if inspected is None:
            try:
                await self.client.progress(
                    "POST",
                    "/images/create",
                    params={"fromImage": name},
                    what=f"pull {name}",
                    log=lambda line: None,
                )
                inspected = await self._inspect_image(name)
            except DockerEngineError as exc:
                raise ConfigError(
                    f"template {name!r} is neither 'python', a built template, nor an image the "
                    f"Engine has, and it could not be pulled ({exc}): build it "
                    "(`rollbox template build --provider docker`), `docker load` it, or check "
                    "the name"
                ) from exc
            if inspected is None:
                raise ConfigError(f"image {name!r} could not be pulled")
        return _Image(
            id=inspected["Id"],
            template=name,
            template_id=inspected["Id"],
            env=_image_env(inspected),
        )

    async def _base_image(self, base: str, log: BuildLog) -> _Image:
        """The image of a base: ``python`` and ``debian:SUITE`` are imported from root filesystems."""
        suite = debian_suite(base)
        if base == "python":
            tag = f"rollbox/python:{host_python_fingerprint()}"
        elif suite is not None:
            root = await asyncio.to_thread(base_rootfs, base, log)
            tag = f"rollbox/debian:{suite}-{os.path.basename(root)[:16]}"
        else:
            return await self._named_image(base)
        inspected = await self._inspect_image(tag)
        if inspected is None:
            log(f"base {base}: importing {tag}")
            root = await asyncio.to_thread(base_rootfs, base, log)
            repository, _, version = tag.partition(":")
            with tempfile.TemporaryDirectory(prefix="rollbox-import-") as scratch:
                archive = Path(scratch) / "rootfs.tar"
                await asyncio.to_thread(write_rootfs_tar, root, archive)
                await self.client.progress(
                    "POST",
                    "/images/create",
                    params={
                        "fromSrc": "-",
                        "repo": repository,
                        "tag": version,
                        "changes": [
                            "ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
                            "ENV LANG=C.UTF-8",
                            f"LABEL {_TEMPLATE_LABEL}.base={base}",
                        ],
                    },
                    content=_file_chunks(archive),
                    headers={"Content-Type": "application/x-tar"},
                    what=f"import base {base}",
                    log=log,
                )
            inspected = await self._inspect_image(tag)
            if inspected is None:
                raise TemplateBuildError(f"importing base {base} as {tag} made no image")
        identity = "python:" + host_python_fingerprint()[:12] if base == "python" else tag
        return _Image(
            id=inspected["Id"], template=base, template_id=identity, env=_image_env(inspected)
        )

    async def find_template(self, name_or_digest: str) -> _Image | None:
        """A template built on this Engine, by name (newest) or by digest (``tpl-...``)."""
        if name_or_digest.startswith("tpl-"):
            filters = _filters(**{_TEMPLATE_LABEL: name_or_digest})
        else:
            filters = _filters(**{f"{_TEMPLATE_LABEL}.name": name_or_digest})
        images = (await self.client.call("GET", "/images/json", params={"filters": filters})).json()
        if not images:
            return None
        newest = max(images, key=lambda image: image.get("Created", 0))
        labels = newest.get("Labels") or {}
        inspected = await self._inspect_image(newest["Id"])
        return _Image(
            id=newest["Id"],
            template=labels.get(f"{_TEMPLATE_LABEL}.name", name_or_digest),
            template_id=labels.get(_TEMPLATE_LABEL, newest["Id"]),
            env=_image_env(inspected or {}),
        )

    async def list_templates(self) -> list[dict[str, Any]]:
        """The templates built on this Engine: name, digest, image, size, created."""
        images = (
            await self.client.call(
                "GET", "/images/json", params={"filters": _filters(**{_TEMPLATE_LABEL: None})}
            )
        ).json()
        found = []
        for image in images:
            labels = image.get("Labels") or {}
            if f"{_TEMPLATE_LABEL}.name" not in labels:
                continue
            found.append(
                {
                    "name": labels[f"{_TEMPLATE_LABEL}.name"],
                    "digest": labels[_TEMPLATE_LABEL],
                    "image": image["Id"],
                    "size_bytes": image.get("Size", 0),
                    "created": datetime.fromtimestamp(image.get("Created", 0), UTC),
                }
            )
        return sorted(found, key=lambda t: t["created"], reverse=True)

    async def remove_template(self, name_or_digest: str) -> list[str]:
        """Remove a built template's images; returns their template digests."""
        removed = []
        while (image := await self.find_template(name_or_digest)) is not None:
            await self.client.call("DELETE", f"/images/{image.id}", params={"force": "1"})
            self._images = {k: v for k, v in self._images.items() if v.id != image.id}
            removed.append(image.template_id)
        return removed

    async def build_template(self, template: Template, log: BuildLog | None = None) -> _Image:
        """Build ``template`` into an image (once: it is found by its digest afterwards).

        Raises:
            TemplateBuildError: a step failed; the message names it and shows its output.
        """
        log = log or (lambda line: None)
        check_steps_fit_base(template)
        digest = short(template.digest)
        found = await self.find_template(digest)
        if found is not None:
            log(f"{template.name}: cached ({digest})")
            return _Image(found.id, template.name, digest, found.env)
        base = await self._base_image(template.base, log)
        context, preamble = await asyncio.to_thread(docker_build_context, template, base.id)
        labels = {_TEMPLATE_LABEL: digest, f"{_TEMPLATE_LABEL}.name": template.name}
        image_id = await self._build(
            context,
            labels,
            tag=f"rollbox/template-{template.name.lower()}:{digest}",
            what=f"template {template.name}",
            log=log,
            template=template,
            preamble=preamble,
        )
        inspected = await self._inspect_image(image_id)
        log(f"{template.name}: built {digest}")
        return _Image(image_id, template.name, digest, _image_env(inspected or {}))

    async def _build(
        self,
        context: bytes,
        labels: dict[str, str],
        *,
        tag: str | None,
        what: str,
        log: BuildLog,
        template: Template | None = None,
        preamble: int = 0,
    ) -> str:
        """``POST /build``; returns the image id or raises TemplateBuildError naming the step."""
        params: dict[str, Any] = {
            "rm": "1",
            "forcerm": "1",
            "networkmode": "host",  # template steps (apt, pip) fetch packages, as docker build does
            "labels": json.dumps(labels),
        }
        if tag:
            params["t"] = tag
        output: list[str] = []
        current = [0]

        def record(line: str) -> None:
            log(line)
            output.append(line)
            del output[:-40]
            if line.startswith("Step ") and "/" in line:
                with contextlib.suppress(ValueError):
                    current[0] = int(line.split()[1].split("/")[0])

        messages = await self.client.progress(
            "POST",
            "/build",
            params=params,
            content=context,
            headers={"Content-Type": "application/x-tar"},
            what=f"build {what}",
            log=record,
        )
        for message in messages:
            if "error" in message:
                where = what
                # the Dockerfile has `preamble` instructions, then one per step
                if template is not None and preamble < current[0] <= preamble + len(template.steps):
                    index = current[0] - preamble
                    where = (
                        f"{what}: step {index}/{len(template.steps)} "
                        f"({describe(template.steps[index - 1])})"
                    )
                tail = "\n".join(output[-20:])
                raise TemplateBuildError(f"{where} failed: {message['error'].strip()}\n{tail}")
        image_id = next(
            (m["aux"]["ID"] for m in reversed(messages) if isinstance(m.get("aux"), dict)), None
        )
        if image_id is None:
            raise TemplateBuildError(f"{what}: the Engine reported no image")
        return image_id

    # -- sandboxes -------------------------------------------------------------------------

    async def create(
        self, spec: SandboxSpec, *, wait_for_slot: bool = True, slot_timeout_seconds: float = 300.0
    ) -> DockerSandbox:
        if self._closed:
            raise SandboxStartError("this DockerProvider is closed")
        if spec.network.enabled:
            raise BackendUnavailableError(
                "the docker provider gives sandboxes no network; NetworkConfig allow-lists are "
                "a feature of the local provider"
            )
        image = await self._image_for(spec)
        await self._slots.take(wait_for_slot, slot_timeout_seconds)
        sandbox = DockerSandbox(self, "sb-" + secrets.token_hex(6))
        sandbox._holds_slot = True
        self._live_here[sandbox.id] = sandbox
        self._live.add(sandbox)
        await sandbox._boot(spec, image)
        return sandbox

    async def _remove_container(self, container_id: str) -> None:
        try:
            await self.client.call(
                "DELETE", f"/containers/{container_id}", params={"force": "1", "v": "1"}
            )
        except DockerEngineError as exc:
            if exc.status not in (404, 409):  # gone, or AutoRemove is removing it already
                raise

    def _remove_container_now(self, container_id: str) -> None:
        try:
            self.client.sync_call(
                "DELETE", f"/containers/{container_id}", params={"force": "1", "v": "1"}
            )
        except DockerEngineError as exc:
            if exc.status not in (404, 409):
                raise

    async def list(self) -> list[SandboxInfo]:
        return [s.info() for s in self._live_here.values() if s.alive]

    async def get(self, sandbox_id: str) -> DockerSandbox:
        sandbox = self._live_here.get(sandbox_id)
        if sandbox is None or not sandbox.alive:
            raise SandboxDeadError(
                f"no live sandbox {sandbox_id!r} in this provider", sandbox_id=sandbox_id
            )
        return sandbox

    async def delete_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.provider != "docker":
            raise ConfigError(f"snapshot {snapshot.id} belongs to the {snapshot.provider} provider")
        self._deleted_snapshots.add(snapshot.ref)
        await self._remove_snapshot_image(snapshot.ref)

    async def _remove_snapshot_image(self, image_id: str) -> None:
        """Remove a deleted snapshot's image, unless its sandboxes still run (then at their end)."""
        if any(s.alive and s._image and s._image.id == image_id for s in self._live_here.values()):
            return
        try:
            await self.client.call("DELETE", f"/images/{image_id}", params={"force": "1"})
        except DockerEngineError as exc:
            if exc.status == 409:  # a container is still going away; the reaper gets it later
                return
            if exc.status != 404:
                raise
        self._snapshots_made.discard(image_id)

    async def close(self) -> None:
        self._closed = True
        sandboxes = [s for s in self._live_here.values() if s.alive]
        await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)
        self._live_here.clear()
        await self.client.aclose()

    def cleanup(self) -> int:
        """Remove containers and snapshot images whose owning process died or whose TTL passed."""
        reaped = 0
        now = time.time()
        containers = self.client.sync_call(
            "GET", "/containers/json", params={"all": "1", "filters": _filters(**{_LABEL: None})}
        ).json()
        for container in containers:
            labels = container.get("Labels") or {}
            expires = float(labels.get("rollbox.expires") or 0)
            if _owner_gone(labels.get("rollbox.owner")) or (expires and now > expires + 5):
                with contextlib.suppress(DockerEngineError):
                    self._remove_container_now(container["Id"])
                    reaped += 1
        images = self.client.sync_call(
            "GET", "/images/json", params={"filters": _filters(**{_SNAPSHOT_LABEL: None})}
        ).json()
        for image in images:
            if _owner_gone((image.get("Labels") or {}).get("rollbox.owner")):
                with contextlib.suppress(DockerEngineError):
                    self.client.sync_call("DELETE", f"/images/{image['Id']}", params={"force": "1"})
                    reaped += 1
        return reaped

    def _at_exit(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child's copy: the containers and images are the parent's
        for sandbox in list(self._live_here.values()):
            if sandbox.alive:
                sandbox._destroy_now()
        for image_id in list(self._snapshots_made):
            with contextlib.suppress(Exception):
                self.client.sync_call("DELETE", f"/images/{image_id}", params={"force": "1"})


def _image_env(inspected: dict[str, Any]) -> dict[str, str]:
    """The environment an image sets (commands get it, as ``docker run`` would give it)."""
    env = {}
    for item in (inspected.get("Config") or {}).get("Env") or []:
        key, _, value = item.partition("=")
        if key and key != "HOSTNAME":
            env[key] = value
    return env


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := await asyncio.to_thread(handle.read, 1 << 20):
            yield chunk


_providers: weakref.WeakSet[DockerProvider] = weakref.WeakSet()
_hook_installed = False


def _at_exit() -> None:
    for provider in list(_providers):
        with contextlib.suppress(Exception):
            provider._at_exit()


def _install_exit_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        atexit.register(_at_exit)
        _hook_installed = True
