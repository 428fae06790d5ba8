"""Resource exhaustion from inside a sandbox: every limit holds, with its own observable effect.

Each test attacks one sandbox while a bystander sandbox (created before the attack) must keep
working, checks the host, and ends with the leak check after killing both.
"""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from _attack_helpers import (
    DISK_MB,
    FORK_UNTIL_REFUSED,
    MB,
    MEMORY_MB,
    OUTPUT_BYTES,
    PIDS,
    assert_answers,
    assert_no_leftovers,
    cgroup_file,
    host_peak_rss_mb,
    host_rss_mb,
    new_sandbox,
    sh,
)

from rollbox.errors import SandboxDeadError, SandboxFileError
from rollbox.sandbox.models import Limits


async def test_fork_bomb_is_held_by_the_pids_cgroup(provider: object) -> None:
    bystander = await new_sandbox(provider)
    sb = await new_sandbox(provider)

    # The observable: fork() fails with EAGAIN once pids.max is reached, not earlier.
    result = await sh(sb, "python3 -", stdin=FORK_UNTIL_REFUSED)
    forked, failure = result.stdout.split()
    assert failure == "EAGAIN", result
    assert PIDS - 8 <= int(forked) < PIDS, result  # the pids cgroup stopped it, nothing else

    # The classic bomb keeps its foreground alive, so only the timeout ends it; every bomb
    # process must die with it (they all sit in the command's cgroup).
    bomb = await sh(sb, "bash -c ':(){ :|:& };:; sleep 600'", timeout_seconds=3)
    assert bomb.timed_out and bomb.exit_code == -9, bomb
    # The limit was reached (one over it at most: the agent moving itself into the next
    # command's cgroup is charged to the new one a moment before the old one is uncharged;
    # moves are not forks, and the kernel checks the limit only at fork) ...
    assert PIDS <= int(cgroup_file(sb, "pids", "pids.peak")) <= PIDS + 1
    # ... and the bomb is gone. Killed processes hold their pid until PID 1 (the agent) reaps
    # them, which may come just after the result: allow it a few seconds (not a timing bound).
    for _ in range(100):
        if int(cgroup_file(sb, "pids", "pids.current")) <= 3:
            break
        await asyncio.sleep(0.05)
    assert int(cgroup_file(sb, "pids", "pids.current")) <= 3
    assert "bash" not in (await sh(sb, "ps -eo stat=,comm= | grep -v '^Z'")).stdout

    # The host can still fork, the bystander and the attacked sandbox still work.
    assert subprocess.run(["/bin/true"], timeout=10).returncode == 0
    await assert_answers(bystander, "bystander")
    await assert_answers(sb, "attacked sandbox")

    await sb.kill()
    await bystander.kill()
    assert_no_leftovers({sb.id, bystander.id})


async def test_memory_bomb_is_oom_killed_inside_its_cgroup(provider: object) -> None:
    bystander = await new_sandbox(provider)
    sb = await new_sandbox(provider)
    rss_before = host_rss_mb()

    bomb = await sh(
        sb, "python3 -c 'chunks = []\nwhile True: chunks.append(b\"\\1\" * (16 << 20))'"
    )
    # The kernel's OOM killer ended the bomb (SIGKILL, seen by sh as 128 + 9) ...
    assert bomb.exit_code in (137, -9), bomb
    assert not bomb.timed_out
    # ... in the sandbox's own memory cgroup, which never went past its limit.
    oom_kills = dict(
        line.split() for line in cgroup_file(sb, "memory", "memory.oom_control").splitlines()
    )
    assert int(oom_kills["oom_kill"]) >= 1
    assert int(cgroup_file(sb, "memory", "memory.max_usage_in_bytes")) <= MEMORY_MB * MB

    # The agent survived (the sandbox answers), so did the bystander; the host did not grow.
    await assert_answers(sb, "attacked sandbox")
    await assert_answers(bystander, "bystander")
    assert host_rss_mb() - rss_before < 100

    await sb.kill()
    await bystander.kill()
    assert_no_leftovers({sb.id, bystander.id})


FILL = r"""
import errno, os, sys

def fill(path, limit_mb):
    written = 0
    try:
        with open(path, "wb", buffering=0) as handle:
            while written < limit_mb << 20:
                written += handle.write(b"x" * (1 << 20))
    except OSError as exc:
        return written, errno.errorcode[exc.errno]
    return written, "none"

root, disk_mb = sys.argv[1], int(sys.argv[2])
# One file far past disk_mb: RLIMIT_FSIZE (python ignores SIGXFSZ, so the write says EFBIG).
print(*fill(root + "/one", 4 * disk_mb))
os.remove(root + "/one")
# Many files, each below disk_mb, together past it: the tmpfs size (ENOSPC).
total, error, index = 0, "none", 0
while error == "none" and index < 16:
    written, error = fill("%s/part%d" % (root, index), disk_mb // 4)
    total += written
    index += 1
print(total, error)
"""


@pytest.mark.parametrize("mount", ["/work", "/tmp"])
async def test_disk_filler_stops_at_disk_mb(provider: object, mount: str) -> None:
    bystander = await new_sandbox(provider)
    sb = await new_sandbox(provider)

    result = await sh(sb, f"python3 - {mount} {DISK_MB}", stdin=FILL)
    (one_written, one_error), (many_written, many_error) = (
        line.split() for line in result.stdout.splitlines()
    )
    assert one_error == "EFBIG" and int(one_written) <= DISK_MB * MB, result
    assert many_error == "ENOSPC" and int(many_written) <= DISK_MB * MB, result

    # dd gets SIGXFSZ (the default action is restored for commands) or an error; either way
    # nothing past the cap reaches the disk.
    # The file size limit is a hard one: sandboxed code cannot raise it to write past it.
    raise_limit = await sh(sb, "ulimit -f unlimited && echo raised; ulimit -H -f")
    assert "raised" not in raise_limit.stdout, raise_limit
    assert raise_limit.stdout.split()[-1] == str(DISK_MB * MB // 512), raise_limit  # blocks

    dd = await sh(
        sb, f"rm -f {mount}/part*; dd if=/dev/zero of={mount}/dd bs=1M count={4 * DISK_MB}"
    )
    assert dd.exit_code != 0, dd
    size = await sh(sb, f"stat -c %s {mount}/dd")
    assert int(size.stdout) <= DISK_MB * MB, size

    # The file API hits the same wall and says so ("no space left (Limits.disk_mb)"). The
    # write is small: a write bigger than disk_mb is test_file_api_attacks' business.
    await sh(sb, f"rm -f {mount}/dd; head -c {DISK_MB - 2}M /dev/zero > {mount}/big")
    with pytest.raises(SandboxFileError, match="disk_mb"):
        await sb.files.write(f"{mount}/api", b"x" * (4 * MB))

    # Only this sandbox's mount is full: the bystander's is its own.
    await bystander.files.write(f"{mount}/fine", b"y" * MB)
    assert (await bystander.files.read(f"{mount}/fine")) == b"y" * MB
    await assert_answers(sb, "attacked sandbox")

    await sb.kill()
    await bystander.kill()
    assert_no_leftovers({sb.id, bystander.id})


async def test_storage_outside_work_and_tmp_is_bounded_by_disk_mb(provider: object) -> None:
    """/dev (and /dev/shm) must not be a way around disk_mb.

    Memory is generous here so that the memory cgroup is not what stops the writer: only a
    size limit on every writable mount can.
    """
    limits = Limits(memory_mb=256, pids=64, disk_mb=16, output_bytes=OUTPUT_BYTES)
    sb = await new_sandbox(provider, limits)
    script = FILL.split("root, disk_mb")[0] + (
        "total = 0\n"
        "for directory in ('/dev', '/dev/shm'):\n"
        "    for index in range(4):\n"
        "        total += fill('%s/fill%d' % (directory, index), 16)[0]\n"
        "print(total)\n"
    )
    result = await sh(sb, "python3 -", stdin=script)
    assert result.exit_code == 0, result
    stored = int(result.stdout)
    assert stored <= 16 * MB, (
        f"sandboxed code stored {stored // MB} MB in /dev and /dev/shm with disk_mb=16"
    )
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_filling_tmpfs_past_memory_mb_does_not_kill_the_sandbox(provider: object) -> None:
    """/work is a tmpfs charged to the memory cgroup. With disk_mb above memory_mb (the
    defaults are 1024 and 512), a big file must fail the writer, not OOM-kill the agent."""
    limits = Limits(memory_mb=64, pids=64, disk_mb=256, output_bytes=OUTPUT_BYTES)
    bystander = await new_sandbox(provider)
    sb = await new_sandbox(provider, limits)
    script = FILL.split("root, disk_mb")[0] + "print(*fill('/work/big', 200))\n"
    try:
        result = await sh(sb, "python3 -", stdin=script)
    except SandboxDeadError as exc:
        pytest.fail(f"filling /work past memory_mb killed the whole sandbox: {exc}")
    assert result.exit_code != 0 or "none" not in result.stdout, result  # the writer failed
    await sh(sb, "rm -f /work/big")
    await assert_answers(sb, "attacked sandbox")
    await assert_answers(bystander, "bystander")
    await sb.kill()
    await bystander.kill()
    assert_no_leftovers({sb.id, bystander.id})


async def test_oom_that_takes_the_agent_is_reported_as_oom(provider: object) -> None:
    """Code that lowers its own OOM score back to the agent's and fills tmpfs may get the agent
    killed: then the sandbox is dead with reason "oom" (the policy's failure), never a vague
    infrastructure error. Either outcome leaves the host and the bystander untouched."""
    limits = Limits(memory_mb=64, pids=64, disk_mb=256, output_bytes=OUTPUT_BYTES)
    bystander = await new_sandbox(provider)
    sb = await new_sandbox(provider, limits)
    try:
        await sh(
            sb,
            "echo 0 > /proc/self/oom_score_adj; exec dd if=/dev/zero of=/work/big bs=1M count=200",
        )
    except SandboxDeadError as exc:
        assert exc.reason == "oom", exc
        assert "memory_mb" in str(exc)
    await assert_answers(bystander, "bystander")
    await sb.kill()
    await bystander.kill()
    assert_no_leftovers({sb.id, bystander.id})


@pytest.mark.slow
async def test_output_flood_is_truncated_and_host_memory_stays_flat(provider: object) -> None:
    bystander = await new_sandbox(provider)
    sb = await new_sandbox(provider)
    rss_before, peak_before = host_rss_mb(), host_peak_rss_mb()

    # 10 GB on stdout and 1 GB on stderr: measured at ~3.5 s for the 10 GB through the agent's
    # pipe on this VM, so the full size is used.
    flood = asyncio.ensure_future(
        sh(sb, "head -c 10G /dev/zero; head -c 1G /dev/zero >&2", timeout_seconds=120)
    )
    answered = 0
    while not flood.done():  # other sandboxes keep working during the flood
        await assert_answers(bystander, "bystander during the flood")
        answered += 1
        await asyncio.sleep(0.2)
    result = await flood

    assert result.exit_code == 0 and not result.timed_out, result.exit_code
    assert result.truncated
    assert result.stdout == "\0" * OUTPUT_BYTES  # the first output_bytes, exactly
    assert result.stderr == "\0" * OUTPUT_BYTES
    assert answered >= 1
    # Neither the agent's copy nor the host's grew with the flood.
    assert host_rss_mb() - rss_before < 100
    assert host_peak_rss_mb() - peak_before < 100

    await assert_answers(sb, "attacked sandbox")
    await sb.kill()
    await bystander.kill()
    assert_no_leftovers({sb.id, bystander.id})


async def test_endless_output_is_truncated_and_timed_out(provider: object) -> None:
    sb = await new_sandbox(provider)
    peak_before = host_peak_rss_mb()
    result = await sh(sb, "yes flood", timeout_seconds=2)
    assert result.timed_out and result.exit_code == -9, result.exit_code
    assert result.truncated and len(result.stdout) <= OUTPUT_BYTES
    assert result.stdout.startswith("flood\nflood\n")
    assert host_peak_rss_mb() - peak_before < 100
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_streamed_output_flood_is_capped(provider: object) -> None:
    """Callbacks (on_stdout) receive no more than output_bytes either."""
    sb = await new_sandbox(provider)
    received: list[int] = []
    result = await sb.commands.run(
        "head -c 1G /dev/zero",
        on_stdout=lambda text: received.append(len(text)),
        timeout_seconds=60,
    )
    assert result.truncated and len(result.stdout) == OUTPUT_BYTES
    assert sum(received) <= OUTPUT_BYTES
    await sb.kill()
    assert_no_leftovers({sb.id})


@pytest.mark.parametrize(
    "loop",
    [
        "while true; do :; done",
        "trap '' TERM INT HUP; while :; do :; done",  # ignores polite signals
        "python3 -c 'while True: pass'",
    ],
)
async def test_infinite_loop_times_out(provider: object, loop: str) -> None:
    sb = await new_sandbox(provider)
    result = await sh(sb, loop, timeout_seconds=1.5)
    assert result.timed_out and result.exit_code == -9, result
    assert 1.0 <= result.duration_s < 30  # loose sanity bound only
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


BUSY_TWO_PROCESSES = r"""
import os, resource, time
start = time.monotonic()
end = start + 2.0
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() < end:
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print((usage.ru_utime + usage.ru_stime) / (time.monotonic() - start))
"""


async def test_cpu_quota_holds_busy_loops(provider: object) -> None:
    """Two busy processes would use ~2 cores here; cpus=0.5 must hold the whole sandbox near
    half a core. Loose bound only: no tight timing."""
    sb = await new_sandbox(provider, Limits(memory_mb=128, pids=64, cpus=0.5, disk_mb=32))
    result = await sh(sb, "python3 -", stdin=BUSY_TWO_PROCESSES)
    cores_used = float(result.stdout)
    assert 0.05 < cores_used < 1.0, result
    assert int(cgroup_file(sb, "cpu", "cpu.cfs_quota_us")) == 50000
    stat = dict(line.split() for line in cgroup_file(sb, "cpu", "cpu.stat").splitlines())
    if cores_used > 0.4:  # it wanted 2 cores and got near its 0.5: the quota is what held it
        assert int(stat["nr_throttled"]) > 0, stat
    # (on a host busy with other work it may get less than its quota, and never be throttled)
    await sb.kill()
    assert_no_leftovers({sb.id})
