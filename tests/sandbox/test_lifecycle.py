"""Nothing of a sandbox outlives it: kill, exception, garbage collection, Ctrl-C, kill -9."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollbox import AsyncSandbox, Sandbox
from rollbox.sandbox.local import LocalProvider
from tests.conftest import assert_no_leftovers


def _bwrap_children_of(pid: int) -> list[int]:
    """The bwrap processes a host process started (through its spawner helper)."""
    parents: dict[int, int] = {}
    bwraps = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            parents[int(proc.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
            if "(bwrap)" in stat:
                bwraps.append(int(proc.name))
    return [b for b in bwraps if parents.get(parents.get(b, 0), 0) == pid]


def _parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


async def test_kill_removes_everything(provider: LocalProvider) -> None:
    sb = await AsyncSandbox.create(provider=provider)
    await sb.commands.run("sleep 1000 & setsid sleep 1001 &")
    await sb.kill()
    assert_no_leftovers({sb.id})
    assert not _bwrap_children_of(os.getpid())


async def test_exception_in_body_kills(provider: LocalProvider) -> None:
    with pytest.raises(RuntimeError):
        async with await AsyncSandbox.create(provider=provider) as sb:
            await sb.commands.spawn("sleep 1000")
            raise RuntimeError("the agent code failed")
    assert_no_leftovers({sb.id})


async def test_garbage_collection_kills(provider: LocalProvider) -> None:
    sb = await AsyncSandbox.create(provider=provider)
    await sb.commands.run("sleep 1000 &")
    sandbox_id = sb.id
    del sb
    gc.collect()
    await asyncio.sleep(0)
    assert_no_leftovers({sandbox_id})


async def test_cancelled_run_kills_the_command(sandbox: AsyncSandbox) -> None:
    task = asyncio.ensure_future(sandbox.commands.run("sleep 1000; echo never"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert "sleep 1000" not in (await sandbox.commands.run("ps -eo args")).stdout


def test_sync_facade_context_manager() -> None:
    with Sandbox.create(name="sync") as sb:
        assert sb.commands.run("echo hi").stdout == "hi\n"
        sb.files.write("/work/a.txt", "a")
        assert sb.files.read_text("/work/a.txt") == "a"
        process = sb.commands.spawn("sleep 1000")
        assert process.pid > 0
    assert not sb.alive
    assert_no_leftovers({sb.id})


_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from rollbox import Sandbox
    sb = Sandbox.create(name="victim")
    sb.commands.run("sleep 1000 >/dev/null 2>&1 &")
    print(sb.id, flush=True)
    if sys.argv[1] == "run":
        sb.commands.run("sleep 1000")   # Ctrl-C lands here
    else:
        time.sleep(1000)
    """
)


def _start_owner(mode: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    owner = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={**os.environ, **(env or {})},
    )
    assert owner.stdout is not None
    sandbox_id = owner.stdout.readline().strip()
    assert sandbox_id.startswith("sb-"), sandbox_id
    return owner, sandbox_id


def test_ctrl_c_leaves_nothing() -> None:
    owner, sandbox_id = _start_owner("run")
    time.sleep(0.3)
    owner.send_signal(signal.SIGINT)
    assert owner.wait(timeout=30) != 0  # KeyboardInterrupt
    assert_no_leftovers({sandbox_id})


def test_kill_9_of_the_owner_is_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    # A state directory of its own, so that no other process's reaper gets there first.
    state = Path(f"/run/rollbox-test-{os.getpid()}")
    monkeypatch.setenv("ROLLBOX_STATE_DIR", str(state))
    owner, sandbox_id = _start_owner("sleep", {"ROLLBOX_STATE_DIR": str(state)})
    try:
        bwraps = _bwrap_children_of(owner.pid)
        assert bwraps, "the owner should have started a bwrap"
        spawners = {_parent_of(pid) for pid in bwraps}
    finally:
        owner.kill()
        owner.wait(timeout=10)
    # The spawner helper exits with its owner, bwrap (--die-with-parent) with the spawner; the
    # cgroups and the record are the reaper's.
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in [*bwraps, *spawners]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in [*bwraps, *spawners]), "the owner's processes outlived it"
    # what the dead owner left: its record and cgroups, until a provider starts and reaps them
    assert (LocalProvider.state_path() / f"{sandbox_id}.json").exists()
    assert LocalProvider().reaped_at_start >= 1
    assert_no_leftovers({sandbox_id})
    subprocess.run(["rm", "-rf", str(state)], check=True)


async def test_cancelled_create_leaves_nothing(provider: LocalProvider) -> None:
    records = LocalProvider.state_path()
    before = {p.name for p in records.glob("*.json")}
    for delay in (0, 0.001, 0.003, 0.006, 0.01, 0.02, 0.05):
        task = asyncio.ensure_future(AsyncSandbox.create(provider=provider))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            sandbox = await task
        except asyncio.CancelledError:
            continue
        await sandbox.kill()  # it was ready before the cancel landed
    new = {p.name for p in records.glob("*.json")} - before
    assert not new, f"cancelled creates left records: {new}"
    assert_no_leftovers({name.removesuffix(".json") for name in new})
    assert not [s for s in provider._live_here.values() if s.alive]
