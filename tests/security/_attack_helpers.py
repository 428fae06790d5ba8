"""Shared bits of the security tests: small limits, host-side observers, the leak check."""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from rollbox import AsyncSandbox
from rollbox.sandbox import _host
from rollbox.sandbox.models import ExecResult, Limits

# Small limits keep every attack fast; each test states the ones it relies on.
MEMORY_MB = 128
PIDS = 64
DISK_MB = 32
OUTPUT_BYTES = 64 * 1024
SMALL = Limits(memory_mb=MEMORY_MB, pids=PIDS, cpus=1.0, disk_mb=DISK_MB, output_bytes=OUTPUT_BYTES)
MB = 1024 * 1024


def _root_conftest() -> ModuleType:
    """tests/conftest.py as pytest imported it (found by file, whatever its module name)."""
    wanted = (Path(__file__).resolve().parents[1] / "conftest.py").resolve()
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if filename and Path(filename).resolve() == wanted:
            return module
    raise RuntimeError(f"{wanted} was not imported by pytest")


def assert_no_leftovers(sandbox_ids: set[str]) -> None:
    """The shared leak check of tests/conftest.py: no cgroup, record or process of these ids."""
    _root_conftest().assert_no_leftovers(sandbox_ids)


async def new_sandbox(provider: object, limits: Limits = SMALL, **kwargs: object) -> AsyncSandbox:
    return await AsyncSandbox.create(limits=limits, provider=provider, **kwargs)  # type: ignore[arg-type]


async def sh(sandbox: AsyncSandbox, command: str, **kwargs: object) -> ExecResult:
    kwargs.setdefault("timeout_seconds", 30)
    return await sandbox.commands.run(command, **kwargs)  # type: ignore[arg-type]


async def assert_answers(sandbox: AsyncSandbox, label: str = "") -> None:
    """The sandbox still runs a command and returns its output."""
    result = await sh(sandbox, "echo still-$((40 + 2))", timeout_seconds=20)
    assert (result.exit_code, result.stdout) == (0, "still-42\n"), (label, result)


def host_rss_mb() -> float:
    """This (host) process's resident memory now, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def host_peak_rss_mb() -> float:
    """This process's peak resident memory so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cgroup_file(sandbox: AsyncSandbox, controller: str, name: str) -> str:
    """A cgroup file of the sandbox, read on the host (before the sandbox is killed)."""
    layout = _host.cgroup_layout()
    assert layout is not None
    return (layout.parents[controller] / sandbox.id / name).read_text()


def host_cmdlines() -> list[str]:
    """The command lines of every process on the host."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def host_canary_file() -> Iterator[tuple[Path, str]]:
    """A world-readable, world-writable file on the host (under /tmp) with unique content.

    Permissions would let the sandbox user (uid 65534) read and write it: only the sandbox's
    own mount namespace hides it. Yields (path, content).
    """
    directory = Path(tempfile.mkdtemp(prefix="rollbox-canary-", dir="/tmp"))
    try:
        os.chmod(directory, 0o777)
        content = f"host-canary-{secrets.token_hex(16)}"
        canary = directory / "canary.txt"
        canary.write_text(content)
        os.chmod(canary, 0o666)
        yield canary, content
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# Forks sleeping children until fork() fails; prints how many it made and the errno's name.
FORK_UNTIL_REFUSED = r"""
import errno, os, signal, time
children, failure = [], None
while True:
    try:
        pid = os.fork()
    except OSError as exc:
        failure = errno.errorcode[exc.errno]
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(len(children), failure)
"""
