"""Local snapshots: directories of captured sandbox files, used as read-only overlay layers.

A snapshot directory holds ``work/``, ``tmp/`` and (for root filesystem templates) ``root/``,
written here from the tar stream that the sandbox's agent makes of its own files. The stream
comes from a sandbox, so it is hostile data: members are written below the snapshot directory
only, through parents this code created (never through a link), regular files are created with
``O_EXCL | O_NOFOLLOW``, links are stored as links and never followed, set-id bits are dropped
and everything is owned by the sandbox user. Nothing else writes to the directory meanwhile.

Forks stack the directory as an extra read-only ``--overlay-src`` layer under their own
writable layer: starting a sandbox from a snapshot costs the same at any snapshot size.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import stat
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO

from rollbox.sandbox import _host
from rollbox.sandbox.models import Snapshot
from rollbox.sandbox.templates import cache_dir

_TOPS = ("work", "tmp", "root")
_OWNER_FILE = "owner.json"
_META_FILE = "snapshot.json"
_mine: set[Path] = set()  # snapshot directories this process made (removed at exit)


def snapshots_dir() -> Path:
    """Where local snapshots live (under the template cache: on disk, not in RAM)."""
    return cache_dir() / "snapshots"


def new_directory() -> tuple[str, Path]:
    """A fresh, private snapshot directory and its id; recorded as this process's."""
    root = snapshots_dir()
    root.mkdir(parents=True, exist_ok=True)
    for path in (root.parent, root):
        os.chmod(path, 0o755)  # bwrap opens the layers as the sandbox user
    snapshot_id = "snap-" + secrets.token_hex(6)
    directory = root / snapshot_id
    directory.mkdir(mode=0o700)
    pid = os.getpid()
    (directory / _OWNER_FILE).write_text(
        json.dumps({"pid": pid, "start": _host.process_start_time(pid)})
    )
    _mine.add(directory)
    _install_exit_hook()
    return snapshot_id, directory


def publish(snapshot: Snapshot, directory: Path) -> None:
    """Record the snapshot's metadata and open its directory to the sandbox user (read-only)."""
    (directory / _META_FILE).write_text(snapshot.model_dump_json(by_alias=True))
    for top in _TOPS:
        (directory / top).mkdir(exist_ok=True)
        os.chown(directory / top, _host.SANDBOX_UID, _host.SANDBOX_UID)
    os.chmod(directory, 0o755)


def extract(stream: IO[bytes], directory: Path) -> int:
    """Write a capture tar into ``directory`` safely; returns the bytes of file data written."""
    uid = gid = _host.SANDBOX_UID
    written = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if (
                not parts
                or parts[0] not in _TOPS
                or member.name.startswith("/")
                or any(part in ("", ".", "..") for part in parts)
            ):
                continue  # not something the agent makes: ignore it
            parent = _real_parent(directory, parts[:-1], uid, gid)
            if parent is None:
                continue
            target = parent / parts[-1]
            mode = member.mode & 0o1777  # no set-uid/set-gid
            if member.isdir():
                try:
                    st = os.lstat(target)
                except FileNotFoundError:
                    os.mkdir(target, 0o700)
                    st = os.lstat(target)
                if not stat.S_ISDIR(st.st_mode):
                    continue
                os.chown(target, uid, gid, follow_symlinks=False)
                os.chmod(target, mode | 0o700 if len(parts) == 1 else mode)
                if member.pax_headers.get("ROLLBOX.opaque") == "1":
                    # a directory of the root the sandbox owned: shown as captured, whatever the
                    # layers below hold (the sandboxes' overlays read user.* xattrs)
                    os.setxattr(target, "user.overlay.opaque", b"y", follow_symlinks=False)
                continue
            _remove_entry(target)
            if member.issym():
                os.symlink(member.linkname, target)
                os.chown(target, uid, gid, follow_symlinks=False)
            elif member.isreg():
                source = tar.extractfile(member)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    if source is not None:
                        while block := source.read(1 << 20):
                            os.write(fd, block)
                            written += len(block)
                    os.fchown(fd, uid, gid)
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
                os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)
    return written


def _real_parent(directory: Path, parts: tuple[str, ...], uid: int, gid: int) -> Path | None:
    """``directory/parts``, made of real directories (created as needed); None if a link is in it."""
    current = directory
    for part in parts:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            os.chown(current, uid, gid)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return None
    return current


def _remove_entry(path: Path) -> None:
    """Remove what a later member replaces (a tar may name a path twice)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def retire(snapshot: Snapshot) -> Path | None:
    """Take a snapshot out of use at once (no new forks); returns where it now is, or None.

    The directory is renamed, not removed: running forks stack it as a layer, so it is removed
    (``remove_directory``) when the last of them ends, or when its owner process exits.
    """
    directory = Path(snapshot.ref)
    if directory.parent != snapshots_dir() or not directory.name.startswith("snap-"):
        raise ValueError(f"{snapshot.ref} is not a local snapshot directory")
    trash = directory.with_name(f".deleting-{directory.name}")
    try:
        os.rename(directory, trash)
    except FileNotFoundError:
        return None
    if directory in _mine:
        _mine.discard(directory)
        _mine.add(trash)
    return trash


def remove_directory(directory: Path) -> None:
    _mine.discard(directory)
    shutil.rmtree(directory, ignore_errors=True)


def reap() -> int:
    """Remove snapshots (deleted ones too) whose owning process is gone; returns how many."""
    root = snapshots_dir()
    if not root.is_dir():
        return 0
    reaped = 0
    for directory in root.iterdir():
        try:
            owner = json.loads((directory / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None and _host.process_start_time(owner["pid"]) == owner["start"]:
            continue
        remove_directory(directory)
        reaped += 1
    return reaped


def _remove_mine() -> None:
    for directory in list(_mine):
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads((directory / _OWNER_FILE).read_text())
            if owner["pid"] == os.getpid():  # never a parent's, from a forked child
                remove_directory(directory)


_hook_installed = False


def _install_exit_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        atexit.register(_remove_mine)
        _hook_installed = True
