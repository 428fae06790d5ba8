"""The host-side file API against hostile sandbox contents: symlinks, `..`, special files.

Sandboxed code prepares traps, then the host calls files.read/write/list/remove/download_dir
the way a verifier would. A host canary (world-readable and world-writable, so that only
isolation protects it) must never change, and its content must never come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _attack_helpers import (
    DISK_MB,
    MB,
    assert_answers,
    assert_no_leftovers,
    host_canary_file,
    new_sandbox,
    sh,
)

from rollbox.errors import SandboxDeadError, SandboxFileError


@pytest.fixture
def host_canary() -> Iterator[tuple[Path, str]]:
    with host_canary_file() as canary:
        yield canary


@pytest.fixture
def host_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="rollbox-download-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def snapshot(directory: Path) -> dict[str, str]:
    """Every entry under a host directory: files by content hash, links by target."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[str(path)] = "dir"
    return found


async def make_traps(sandbox: object, canary: Path) -> None:
    result = await sh(
        sandbox,  # type: ignore[arg-type]
        f"""
        set -e
        cd /work
        ln -s /etc/shadow l_shadow
        ln -s /root l_root
        ln -s /proc/1/root l_proc_root
        ln -s / l_slash
        ln -s {canary} l_canary
        ln -s {canary.parent} l_canary_dir
        ln -s /proc/1/root{canary} l_proc_canary
        ln -s ../../../../../../..{canary} l_up_canary
        mkdir -p deep/er && ln -s ../../l_canary deep/er/chain
        """,
    )
    assert result.exit_code == 0, result


async def test_symlinks_cannot_read_host_files(
    provider: object, host_canary: tuple[Path, str]
) -> None:
    canary, content = host_canary
    sb = await new_sandbox(provider)
    await make_traps(sb, canary)

    for path in [
        "/work/l_shadow",
        "/work/l_root/.bashrc",
        "/work/l_canary",
        "/work/l_canary_dir/canary.txt",
        "/work/l_proc_canary",
        "/work/l_up_canary",
        "/work/deep/er/chain",
        f"/work/l_proc_root{canary}",
        f"/work/l_slash{canary}",
        f"/proc/1/root{canary}",
        f"/proc/self/root{canary}",
        str(canary),
        f"/work/../../../..{canary}",
        "/etc/shadow",
    ]:
        # Every path resolves inside the sandbox, where none of these exists.
        with pytest.raises(SandboxFileError):
            data = await sb.files.read(path)
            assert content.encode() not in data, path
    assert not await sb.files.exists(str(canary))
    with pytest.raises(SandboxFileError):
        await sb.files.list("/work/l_canary_dir")

    # A directory symlink to / lists the sandbox's root, not the host's.
    names = {entry.name for entry in await sb.files.list("/work/l_slash")}
    assert "work" in names and not names & {"root", "home", "boot", "var", "run"}, names
    # Listings report symlinks as symlinks, with no size or type taken from their target.
    entries = {entry.name: entry for entry in await sb.files.list("/work")}
    assert all(entries[name].type == "symlink" for name in entries if name.startswith("l_"))

    assert canary.read_text() == content
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_symlinks_and_dotdot_cannot_write_host_files(
    provider: object, host_canary: tuple[Path, str]
) -> None:
    canary, content = host_canary
    host_passwd = Path("/etc/passwd").read_bytes()
    sb = await new_sandbox(provider)
    await make_traps(sb, canary)

    for path in [
        "/work/l_canary",
        "/work/l_canary_dir/canary.txt",
        "/work/l_proc_canary",
        "/work/l_up_canary",
        "/work/deep/er/chain",
        f"/work/l_slash{canary}",
        f"/work/../../../..{canary}",
        str(canary),
    ]:
        # Either refused or written inside the sandbox: both fine, as long as the host's file
        # stays as it was.
        with contextlib.suppress(SandboxFileError):
            await sb.files.write(path, "pwned")
        assert canary.read_text() == content, path

    # What a write to the canary's path made lives in the sandbox, and reads back as such.
    assert await sb.files.read_text(str(canary)) == "pwned"

    # `..` is normalised inside the sandbox; /etc there is read-only and not the host's.
    for path in ["/work/../../etc/passwd", "../../../etc/passwd", "/work/l_slash/etc/passwd"]:
        with pytest.raises(SandboxFileError):
            await sb.files.write(path, "root::0:0::/:/bin/sh\n")
    assert Path("/etc/passwd").read_bytes() == host_passwd
    assert (await sb.files.read("/work/../../etc/passwd")) != host_passwd

    # remove() on a symlink removes the link, never its target.
    await sb.files.remove("/work/l_canary_dir", recursive=True)
    await sb.files.remove("/work/l_canary")
    # This one exists, but as the sandbox's own copy made by the write above.
    await sb.files.remove(f"/work/l_slash{canary.parent}", recursive=True)
    assert canary.read_text() == content and canary.parent.is_dir()

    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_download_dir_writes_nothing_outside_its_target(
    provider: object, host_canary: tuple[Path, str], host_dir: Path
) -> None:
    canary, content = host_canary
    sb = await new_sandbox(provider)
    await make_traps(sb, canary)
    result = await sh(
        sb,
        f"""
        set -e
        mkdir -p /work/out/sub/deeper
        echo real > /work/out/real.txt
        echo nested > /work/out/sub/deeper/nested.txt
        ln -s {canary} /work/out/canary.txt
        ln -s {canary.parent} /work/out/canary_dir
        ln -s ../../../../../../../../.. /work/out/up
        ln -s / /work/out/sub/root
        ln -s /proc/1/root /work/out/sub/proc_root
        ln -s /etc /work/out/sub/deeper/etc
        mkfifo /work/out/fifo
        """,
    )
    assert result.exit_code == 0, result
    target = host_dir / "target"
    around_before = snapshot(host_dir)
    canary_dir_before = snapshot(canary.parent)

    count = await sb.files.download_dir("/work/out", target)

    assert count == 2
    got = {str(p.relative_to(target)) for p in target.rglob("*")}
    assert got == {"real.txt", "sub", "sub/deeper", "sub/deeper/nested.txt"}, got
    assert not any(p.is_symlink() for p in target.rglob("*"))
    assert (target / "real.txt").read_text() == "real\n"
    # Nothing changed beside the target, nor in the canary's directory.
    around_after = {k: v for k, v in snapshot(host_dir).items() if not k.startswith(str(target))}
    assert around_after == around_before
    assert snapshot(canary.parent) == canary_dir_before
    assert canary.read_text() == content
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_download_dir_does_not_follow_symlinks_already_in_the_target(
    provider: object, host_canary: tuple[Path, str], host_dir: Path
) -> None:
    """The target may already hold symlinks (a checkout, an earlier upload's source). A
    sandbox directory of the same name must not be written through them: download_dir
    already unlinks such links for files, and must do the same for directories."""
    canary, content = host_canary
    file_canary = host_dir / "file-canary.txt"
    file_canary.write_text(content)
    target = host_dir / "target"
    target.mkdir()
    (target / "docs").symlink_to(canary.parent)  # host links, made by the host
    (target / "notes.txt").symlink_to(file_canary)
    sb = await new_sandbox(provider)
    await sh(
        sb,
        "mkdir -p /work/out/docs && echo pwned > /work/out/docs/canary.txt && "
        "echo pwned > /work/out/docs/dropped.txt && echo pwned > /work/out/notes.txt",
    )
    canary_dir_before = snapshot(canary.parent)

    await sb.files.download_dir("/work/out", target)

    # The file case: the link is replaced, not followed.
    assert file_canary.read_text() == content
    assert (target / "notes.txt").read_text() == "pwned\n"
    # The directory case.
    assert snapshot(canary.parent) == canary_dir_before, (
        "download_dir wrote through a directory symlink in its target into "
        f"{canary.parent}: now {sorted(os.listdir(canary.parent))}, "
        f"canary.txt holds {canary.read_text()!r}"
    )
    await sb.kill()
    assert_no_leftovers({sb.id})


@pytest.mark.parametrize("operation", ["read", "write"])
async def test_file_api_on_a_fifo_does_not_wedge_the_sandbox(
    provider: object, operation: str
) -> None:
    """A verifier reads /work/answer.txt; the model made it a FIFO. The call must fail (or
    return) promptly, and the sandbox must keep answering."""
    sb = await new_sandbox(provider)
    await sh(sb, "mkfifo /work/answer.txt && ln -s answer.txt /work/link.txt")
    call = (
        sb.files.read("/work/link.txt")
        if operation == "read"
        else sb.files.write("/work/link.txt", "expected")
    )
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({task}, timeout=10)
    if not done:
        task.cancel()
        pytest.fail(f"files.{operation} of a FIFO blocked the sandbox's agent for 10 s")
    if task.exception() is not None:
        assert isinstance(task.exception(), SandboxFileError), task.exception()  # refused: fine
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
async def test_file_api_read_of_an_endless_file_fails_cleanly(
    provider: object, target: str
) -> None:
    """/work/answer.txt -> /dev/zero: reading it must not take the agent (or the host) down
    with an unbounded read."""
    sb = await new_sandbox(provider)
    await sh(sb, f"ln -s {target} /work/answer.txt")
    try:
        data = await asyncio.wait_for(sb.files.read("/work/answer.txt"), 20)
        assert len(data) <= DISK_MB * MB  # a bounded read would be acceptable too
    except SandboxFileError:
        pass
    except SandboxDeadError as exc:
        pytest.fail(f"files.read of a symlink to {target} killed the sandbox: {exc}")
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_file_api_write_past_disk_mb_fails_cleanly(provider: object) -> None:
    """A write just over disk_mb (memory_mb is 4x that) is refused as too big; it must not
    cost the sandbox its life."""
    sb = await new_sandbox(provider)
    try:
        with pytest.raises(SandboxFileError, match="disk_mb"):
            await sb.files.write("/work/big", b"x" * ((DISK_MB + 1) * MB))
    except SandboxDeadError as exc:
        pytest.fail(f"a write of disk_mb + 1 MB killed the sandbox: {exc}")
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})
