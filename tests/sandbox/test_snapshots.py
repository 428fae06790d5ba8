"""Snapshots and forks: prepare a sandbox once, start any number of sandboxes from its files."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox import AsyncSandbox, ConfigError, SandboxFileError, SandboxStartError, Snapshot
from rollbox.sandbox import _snapshots
from rollbox.sandbox.base import Provider
from rollbox.sandbox.local import LocalProvider
from rollbox.sandbox.templates import RunStep, Template, short
from tests.sandbox._docker import make_docker_provider

PREPARE = (
    "mkdir -p /work/pkg/sub && echo base > /work/pkg/sub/data.txt && "
    "printf '#!/bin/sh\\necho ran\\n' > /work/run.sh && chmod 755 /work/run.sh && "
    "ln -s pkg/sub/data.txt /work/rel-link && ln -s /etc/hostname /work/abs-link && "
    "echo scratch > /tmp/scratch && echo doomed > /work/doomed"
)


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)], scope="module")
async def any_provider(request: pytest.FixtureRequest) -> AsyncIterator[Provider]:
    provider = LocalProvider() if request.param == "local" else make_docker_provider()
    yield provider
    await provider.close()


async def test_forks_start_from_the_snapshot_and_stay_apart(any_provider: Provider) -> None:
    async with await AsyncSandbox.create(provider=any_provider) as source:
        assert (await source.commands.run(PREPARE)).ok
        snapshot = await source.snapshot()
        await source.commands.run("echo after > /work/pkg/sub/data.txt")  # not in the snapshot
    assert isinstance(snapshot, Snapshot) and snapshot.provider == any_provider.name
    assert snapshot.size_bytes > 0 and snapshot.template == "python"
    try:
        first, second = await asyncio.gather(
            AsyncSandbox.create(from_snapshot=snapshot, provider=any_provider),
            AsyncSandbox.create(from_snapshot=snapshot, provider=any_provider),
        )
        async with first, second:
            seen = await first.commands.run(
                "cat /work/pkg/sub/data.txt /tmp/scratch /work/rel-link && ./run.sh && "
                "readlink /work/abs-link && stat -c '%a %U' /work/run.sh"
            )
            assert seen.stdout == "base\nscratch\nbase\nran\n/etc/hostname\n755 sandbox\n", seen
            # each fork writes and deletes in its own layer
            changed = await first.commands.run(
                "rm /work/doomed && echo mine > /work/pkg/sub/data.txt && echo new > /work/new"
            )
            assert changed.ok, changed
            assert (
                await second.commands.run("cat /work/pkg/sub/data.txt /work/doomed")
            ).stdout == ("base\ndoomed\n")
            assert not await second.files.exists("/work/new")
            info = first.info()
            assert info.snapshot == snapshot.id and info.template_id == snapshot.template_id
            # a snapshot of a fork holds the fork's state, deletions included
            again = await first.snapshot()
            try:
                async with await AsyncSandbox.create(
                    from_snapshot=again, provider=any_provider
                ) as third:
                    listing = await third.commands.run("ls /work; cat /work/pkg/sub/data.txt")
                    assert listing.stdout == "abs-link\nnew\npkg\nrel-link\nrun.sh\nmine\n", listing
            finally:
                await AsyncSandbox.delete_snapshot(again, provider=any_provider)
    finally:
        await AsyncSandbox.delete_snapshot(snapshot, provider=any_provider)


async def test_deleted_snapshot_cannot_start_sandboxes(any_provider: Provider) -> None:
    async with await AsyncSandbox.create(provider=any_provider) as source:
        await source.commands.run("mkdir /work/d && echo kept > /work/d/file")
        snapshot = await source.snapshot()
    async with await AsyncSandbox.create(from_snapshot=snapshot, provider=any_provider) as fork:
        await AsyncSandbox.delete_snapshot(snapshot, provider=any_provider)
        await AsyncSandbox.delete_snapshot(snapshot, provider=any_provider)  # idempotent
        # running forks go on with their files; the snapshot goes when the last of them does
        assert (await fork.commands.run("cat /work/d/file")).stdout == "kept\n"
    with pytest.raises(SandboxStartError, match="deleted"):
        await AsyncSandbox.create(from_snapshot=snapshot, provider=any_provider)
    if snapshot.provider == "local":
        assert not Path(snapshot.ref).exists()
        assert not list(_snapshots.snapshots_dir().glob(f"*{snapshot.id}*"))


async def test_snapshot_of_another_provider_is_refused(provider: LocalProvider) -> None:
    async with await AsyncSandbox.create(provider=provider) as source:
        snapshot = await source.snapshot()
    try:
        foreign = snapshot.model_copy(update={"provider": "docker"})
        with pytest.raises(ConfigError, match="provider='docker'"):
            await AsyncSandbox.create(from_snapshot=foreign, provider=provider)
        with pytest.raises(ConfigError, match="must be a Snapshot"):
            await AsyncSandbox.create(from_snapshot="snap-123", provider=provider)  # type: ignore[arg-type]
    finally:
        await AsyncSandbox.delete_snapshot(snapshot, provider=provider)


async def test_root_filesystem_snapshot_keeps_what_the_sandbox_owned(
    provider: LocalProvider,
) -> None:
    """On a layered template the root's writable layer is captured too, deletions included."""
    template = Template(
        name="snapshot-root",
        steps=[
            RunStep(
                run="mkdir -p /data && echo seed > /data/seed && "
                "chown -R 65534:65534 /data && echo system > /etc/system-file"
            )
        ],
    )
    async with await AsyncSandbox.create(from_template=template, provider=provider) as source:
        changed = await source.commands.run(
            "rm /data/seed && echo grown > /data/grown && echo w > /work/w"
        )
        assert changed.ok, changed
        snapshot = await source.snapshot()
    try:
        async with await AsyncSandbox.create(from_snapshot=snapshot, provider=provider) as fork:
            seen = await fork.commands.run("ls /data; cat /etc/system-file /work/w")
            assert seen.stdout == "grown\nsystem\nw\n", seen
            assert fork.template_id == source.template_id == short(template.digest)
    finally:
        await AsyncSandbox.delete_snapshot(snapshot, provider=provider)


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    buffer.seek(0)
    return buffer


def test_hostile_capture_stream_cannot_write_outside_the_snapshot(tmp_path: Path) -> None:
    """A capture stream is sandbox data: links, '..' and absolute names never leave the dir."""
    victim = tmp_path / "victim"
    victim.mkdir()
    directory = tmp_path / "snap"
    directory.mkdir()

    def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644):
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, link, mode
        return info

    stream = _tar(
        [
            (member("work", tarfile.DIRTYPE, mode=0o755), b""),
            (member("work/escape", tarfile.SYMTYPE, link=str(victim)), b""),
            (member("work/escape/planted"), b"through a link"),
            (member("work/../../outside"), b"dot-dot"),
            (member("/abs"), b"absolute"),
            (member("elsewhere/file"), b"not a top the agent makes"),
            (member("work/setuid", mode=0o4755), b"#!/bin/sh\n"),
            (member("work/dev", tarfile.CHRTYPE), b""),
            (member("work/hard", tarfile.LNKTYPE, link="/etc/passwd"), b""),
        ]
    )
    _snapshots.extract(stream, directory)
    assert list(victim.iterdir()) == []
    assert not (tmp_path / "outside").exists() and not Path("/abs").exists()
    assert sorted(p.name for p in (directory / "work").iterdir()) == ["escape", "setuid"]
    assert (directory / "work/escape").is_symlink()
    assert (directory / "work/setuid").stat().st_mode & 0o7777 == 0o755
    assert not (directory / "elsewhere").exists()


OWNER_SCRIPT = """
import asyncio, os, sys
from rollbox import AsyncSandbox
from rollbox.sandbox.local import LocalProvider

async def main():
    provider = LocalProvider()
    async with await AsyncSandbox.create(provider=provider) as sandbox:
        await sandbox.commands.run("echo kept > /work/kept")
        snapshot = await sandbox.snapshot()
    print(snapshot.ref, flush=True)
    if sys.argv[1] == "hang":
        await asyncio.sleep(600)

asyncio.run(main())
"""


def test_snapshots_go_with_the_process_that_made_them() -> None:
    finished = subprocess.run(
        [sys.executable, "-c", OWNER_SCRIPT, "exit"], capture_output=True, text=True, timeout=60
    )
    made = Path(finished.stdout.strip())
    assert made.parent == _snapshots.snapshots_dir(), finished.stderr
    assert not made.exists(), "a process's snapshots are removed when it exits"

    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, "hang"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        left = Path(owner.stdout.readline().strip())
        assert (left / "work" / "kept").read_text() == "kept\n"
        _snapshots.reap()
        assert left.exists(), "a live owner's snapshot must be kept"
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert left.exists()  # kill -9: nothing ran at exit
        LocalProvider().cleanup()  # what `rollbox cleanup` and every provider start do
        assert not left.exists()
    finally:
        owner.kill()
        owner.wait()
    leftovers = [p for p in _snapshots.snapshots_dir().iterdir() if p.name.startswith(".deleting")]
    assert leftovers == []


async def test_pooled_forks_start_from_the_snapshot() -> None:
    """With a warm pool, forks are booted ahead of demand, with the snapshot's files."""
    provider = LocalProvider(pool_size=2)
    try:
        async with await AsyncSandbox.create(provider=provider) as source:
            await source.commands.run("echo pooled > /work/state")
            snapshot = await source.snapshot()
        for _ in range(4):
            async with await AsyncSandbox.create(from_snapshot=snapshot, provider=provider) as fork:
                assert (await fork.commands.run("cat /work/state")).stdout == "pooled\n"
                assert fork.info().snapshot == snapshot.id
        await AsyncSandbox.delete_snapshot(snapshot, provider=provider)
    finally:
        await provider.close()


def test_sync_facade_snapshots() -> None:
    from rollbox import Sandbox

    with Sandbox.create() as source:
        source.commands.run("echo sync > /work/state")
        snapshot = source.snapshot()
    try:
        with Sandbox.create(from_snapshot=snapshot) as fork:
            assert fork.commands.run("cat /work/state").stdout == "sync\n"
    finally:
        Sandbox.delete_snapshot(snapshot)
    with pytest.raises(SandboxStartError, match="deleted"):
        Sandbox.create(from_snapshot=snapshot)


async def test_links_and_fifos_in_a_snapshotted_sandbox_never_touch_the_host(
    provider: LocalProvider, tmp_path: Path
) -> None:
    """Sandboxed code plants links to host paths and a FIFO; capture and forks stay inside."""
    bait = tmp_path / "bait"
    bait.mkdir(mode=0o777)
    os.chmod(bait, 0o777)
    async with await AsyncSandbox.create(provider=provider) as source:
        planted = await source.commands.run(
            f"ln -s {bait} /work/to-host && ln -s {_snapshots.snapshots_dir()} /work/to-store && "
            "ln -s /work/to-host /work/chain && mkfifo /work/fifo && mkdir /work/d && "
            "ln -s /etc/shadow /work/d/shadow"
        )
        assert planted.ok, planted
        snapshot = await source.snapshot()
    try:
        stored = Path(snapshot.ref) / "work"
        assert os.readlink(stored / "to-host") == str(bait)
        assert not (stored / "fifo").exists()  # FIFOs are not files: skipped, no hang
        assert list(bait.iterdir()) == []
        async with await AsyncSandbox.create(from_snapshot=snapshot, provider=provider) as fork:
            wrote = await fork.commands.run("echo x > /work/to-host/planted; cat /work/d/shadow")
            assert wrote.exit_code != 0  # the link resolves inside the fork, to nothing there
            with pytest.raises(SandboxFileError):  # a dangling link inside the fork
                await fork.files.write("/work/to-store/planted", "x")
        assert list(bait.iterdir()) == [] and not (_snapshots.snapshots_dir() / "planted").exists()
    finally:
        await AsyncSandbox.delete_snapshot(snapshot, provider=provider)
