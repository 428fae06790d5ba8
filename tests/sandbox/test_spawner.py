"""The spawner helper that forks bwrap for the local backend (``_spawner.py``), on its own."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.sandbox import _host
from rollbox.sandbox._spawner import Spawner

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the spawner drops from root")

PROBE = (
    "id -u; id -G; ulimit -f; ulimit -c; wc -c < /proc/$$/environ; "
    "cat <&3; grep :pids: /proc/self/cgroup; grep SigIgn /proc/self/status; "
    "grep -E '^(Uid|Gid|CapPrm|CapEff|CapAmb):' /proc/self/status"
)


@pytest.fixture
def spawner() -> Spawner:
    return Spawner()


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    layout = _host.require_cgroups()
    path = layout.parents["pids"] / f"sb-spawnertest{os.getpid()}"
    path.mkdir()
    yield path
    for _ in range(200):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.01)


def _run(spawner: Spawner, argv: list[str], cgroup_procs: list[str]) -> tuple[str, str]:
    """Spawn ``argv``: its stdout and stderr (the spawner reaps it)."""
    stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
    out_read, out_write = os.pipe2(os.O_CLOEXEC)
    err_read, err_write = os.pipe2(os.O_CLOEXEC)
    extra = os.memfd_create("extra", os.MFD_CLOEXEC)
    os.write(extra, b"fd 3 is the fourth fd passed\n")
    os.lseek(extra, 0, os.SEEK_SET)
    child_fds = [stdin_read, out_write, err_write, extra]
    try:
        pid, start = spawner.spawn(
            argv,
            fds=child_fds,
            cgroup_procs=cgroup_procs,
            home_procs=_host.require_cgroups().own_procs,
            uid=65534,
        )
    finally:
        for fd in child_fds:
            os.close(fd)
    assert start is not None or not Path(f"/proc/{pid}").exists()
    os.close(stdin_write)
    with os.fdopen(out_read, "rb") as out, os.fdopen(err_read, "rb") as err:
        return out.read().decode(), err.read().decode()


def test_the_child_is_the_sandbox_user_in_its_cgroup_with_its_limits(
    spawner: Spawner, pids_cgroup: Path
) -> None:
    out, err = _run(spawner, ["/bin/sh", "-c", PROBE], [str(pids_cgroup / "cgroup.procs")])
    lines = out.splitlines()
    assert err == ""
    assert lines[0] == "65534" and lines[1] == "65534"  # uid; no supplementary groups of root
    assert lines[2] == "unlimited" and lines[3] == "0"  # RLIMIT_FSIZE is the agent's to set
    assert lines[4] == "0"  # the shell started with an empty environment: nothing of the host's
    assert lines[5] == "fd 3 is the fourth fd passed"
    assert lines[6].endswith(f"/rollbox/{pids_cgroup.name}")
    # SIGINT, SIGPIPE, SIGXFSZ... back to default. glibc's posix_spawn leaves its own two signals
    # (32, 33: thread cancellation and set*id) ignored; glibc sets them itself when it uses them.
    ignored = int(lines[7].removeprefix("SigIgn:\t"), 16)
    assert ignored & ~(0b11 << 31) == 0, lines[7]
    # Real, effective, saved and file-system ids all the sandbox user's (the helper spawns with
    # only its real ids changed), and no capability left.
    assert lines[8:] == [
        "Uid:\t65534\t65534\t65534\t65534",
        "Gid:\t65534\t65534\t65534\t65534",
        "CapPrm:\t0000000000000000",
        "CapEff:\t0000000000000000",
        "CapAmb:\t0000000000000000",
    ], lines[8:]


def test_a_spawn_that_cannot_join_its_cgroup_fails_and_never_runs(spawner: Spawner) -> None:
    with pytest.raises(OSError, match="No such file"):
        _run(
            spawner,
            ["/bin/sh", "-c", "echo RAN > /dev/shm/rollbox-spawner-ran"],
            ["/sys/fs/cgroup/pids/no-such-cgroup/cgroup.procs"],
        )
    assert not Path("/dev/shm/rollbox-spawner-ran").exists()
    # ... and the spawner goes on serving, back in its own cgroups
    out, _ = _run(spawner, ["/bin/sh", "-c", "echo again"], [])
    assert out == "again\n"
    helper = spawner._helper
    assert helper is not None
    own = Path("/proc/self/cgroup").read_text()
    assert Path(f"/proc/{helper.pid}/cgroup").read_text() == own


def test_the_helper_goes_back_to_its_own_cgroups_user_and_network(
    spawner: Spawner, pids_cgroup: Path
) -> None:
    _run(spawner, ["/bin/true"], [str(pids_cgroup / "cgroup.procs")])
    helper = spawner._helper
    assert helper is not None
    assert Path(f"/proc/{helper.pid}/cgroup").read_text() == Path("/proc/self/cgroup").read_text()
    status = Path(f"/proc/{helper.pid}/status").read_text()
    assert "Uid:\t0\t0\t0\t0" in status and "Gid:\t0\t0\t0\t0" in status
    assert os.readlink(f"/proc/{helper.pid}/ns/net") == os.readlink("/proc/self/ns/net")
    # (true's pipes close a moment before it leaves its cgroup)
    deadline = time.monotonic() + 10
    while (pids_cgroup / "cgroup.procs").read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (pids_cgroup / "cgroup.procs").read_text() == ""


def test_a_killed_helper_is_started_again(spawner: Spawner) -> None:
    assert _run(spawner, ["/bin/sh", "-c", "echo one"], [])[0] == "one\n"
    helper = spawner._helper
    assert helper is not None
    os.kill(helper.pid, signal.SIGKILL)
    helper.wait()
    assert _run(spawner, ["/bin/sh", "-c", "echo two"], [])[0] == "two\n"
    assert spawner._helper is not helper


def test_the_helper_exits_with_its_host() -> None:
    """Closing the host's end (as its exit does) ends the helper; its pidfd of the host does too."""
    spawner = Spawner()
    _run(spawner, ["/bin/true"], [])
    helper = spawner._helper
    assert helper is not None and helper.poll() is None
    assert spawner._channel is not None
    spawner._channel.close()
    assert helper.wait(timeout=10) == 0
