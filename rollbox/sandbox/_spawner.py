"""Starts bwrap processes for the local backend, from a small helper process of their own.

bwrap must start in the sandbox's cgroups, as the sandbox user, with nothing of the host: the host
process would need a ``preexec_fn`` for that, which makes Python fork rather than vfork. A fork of
a trainer holding gigabytes copies its page tables (~50 ms for 2 GiB, with the GIL held), and every
page either side then writes costs a copy-on-write fault (~10 us each on a VM). So one small
interpreter per host process (``python -I -S`` of this file, stdlib only) starts bwrap with
``posix_spawn`` (a vfork), after stepping into what the child must inherit (see ``_spawn``): the
host sends it a request and the child's pipes over a socket and gets the pid back. A spawn that
cannot be set up fails before bwrap runs, and the host gets the reason.

The helper reaps its children, and exits when its host process does (a pidfd of the host):
bwrap's ``--die-with-parent`` then ends every sandbox, as when the host itself was bwrap's parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading

_CLONE_NEWNET = 0x40000000
_MAX_REQUEST = 1 << 20
# The fds a request carries, in this order; the child gets the first four as 0-3.
STDIN, STDOUT, STDERR, SECCOMP, NETNS = range(5)
SECCOMP_FD_IN_CHILD = 3


# -- the helper process ------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _setns_net(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET): {os.strerror(errno)}")


def _join_cgroups(procs: list[str]) -> None:
    for path in procs:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def _spawn(request: dict, fds: list[int], own_netns: int) -> dict:
    """Start bwrap by ``posix_spawn`` (a vfork: no copy of our page tables, no copy-on-write).

    The child inherits what this process is while it spawns, so the helper itself steps into the
    sandbox's cgroups (v1 has no CLONE_INTO_CGROUP) and network namespace, takes the sandbox
    user as its real ids, and steps back right after. (RLIMIT_FSIZE is the agent's to set: this
    process could not raise its own back.) A fork whose child set itself up in Python cost ~500
    page faults per sandbox between child and parent (~4 ms of CPU on a VM).
    """
    # Above 0-3, where the child's dup2s put them, so that none overwrites another's source.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds[:NETNS]]
    uid = request["uid"]
    root = os.geteuid() == 0
    try:
        _join_cgroups(request["cgroup_procs"])
        if len(fds) > NETNS:  # a failure here aborts the spawn: never the host's network
            _setns_net(fds[NETNS])
        if root:  # as real ids: POSIX_SPAWN_RESETIDS makes them the child's only ids
            os.setresgid(uid, 0, 0)
            os.setresuid(uid, 0, 0)
        pid = os.posix_spawn(
            request["argv"][0],
            request["argv"],
            {},
            file_actions=[(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(high)],
            resetids=root,
            setsigmask=(),
            setsigdef=(signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT),
        )
    finally:
        for fd in high:
            os.close(fd)
        try:
            if root:
                os.setresuid(0, 0, 0)
                os.setresgid(0, 0, 0)
            if len(fds) > NETNS:
                _setns_net(own_netns)
            if request["cgroup_procs"]:
                _join_cgroups(request["home_procs"])
        except BaseException as exc:  # left in a sandbox's cgroup, netns or user: never spawn again
            os.write(2, f"rollbox spawner: cannot step back, exiting: {exc!r}\n".encode())
            os._exit(70)
    # The child is ours until we reap it, so its start time cannot belong to another process.
    return {"pid": pid, "start": _start_time(pid)}


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(channel_fd: int) -> None:
    """The helper's loop: one request, one reply, until the host goes."""
    os.set_inheritable(channel_fd, False)  # it would outlive posix_spawn's exec
    channel = socket.socket(fileno=channel_fd)
    own_netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # for every child
    if os.geteuid() == 0:
        os.setgroups([])  # none of root's supplementary groups for the children
    host = os.getppid()
    host_fd = os.pidfd_open(host)
    if os.getppid() != host:
        return
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    selector.register(host_fd, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fd == host_fd:
                return
            if key.fd == wake_read:
                while True:
                    try:
                        if not os.read(wake_read, 4096):
                            break
                    except BlockingIOError:
                        break
                _reap()
                continue
            message, fds, _, _ = socket.recv_fds(channel, _MAX_REQUEST, 8)
            if not message:
                return
            try:
                reply = _spawn(json.loads(message), fds, own_netns)
            except Exception as exc:  # the host turns it into an error
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                for fd in fds:
                    os.close(fd)
            channel.send(json.dumps(reply).encode())
            _reap()


# -- the host's end ----------------------------------------------------------------------------


class Spawner:
    """The host's connection to its helper, started on first use (again after a fork)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channel: socket.socket | None = None
        self._helper: subprocess.Popen[bytes] | None = None
        self._owner = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # A forked child starts its own helper: the parent's is not its to use.
        self._lock = threading.Lock()
        self._channel = self._helper = None

    def _start(self) -> None:
        if self._channel is not None:
            self._channel.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._helper = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                cwd="/",
                env={},
            )
        finally:
            theirs.close()
        self._channel = ours
        self._owner = os.getpid()

    def _helper_ended(self) -> bool:
        return self._helper is None or self._helper.poll() is not None

    def spawn(
        self,
        argv: list[str],
        *,
        fds: list[int],
        cgroup_procs: list[str],
        home_procs: list[str],
        uid: int,
    ) -> tuple[int, int | None]:
        """Start ``argv`` with ``fds`` (stdin, stdout, stderr, seccomp[, netns]); (pid, start).

        It starts in the cgroups of ``cgroup_procs``; ``home_procs`` are the cgroups the helper
        goes back to (its host's, which it was started in).
        """
        request = json.dumps(
            {
                "argv": argv,
                "cgroup_procs": cgroup_procs,
                "home_procs": home_procs,
                "uid": uid,
            }
        ).encode()
        with self._lock:
            reply = b""
            for _attempt in range(2):  # a helper that died (killed by hand?) is started again
                if self._channel is None or self._owner != os.getpid() or self._helper_ended():
                    self._start()
                assert self._channel is not None
                with contextlib.suppress(OSError):
                    socket.send_fds(self._channel, [request], fds)
                    reply = self._channel.recv(_MAX_REQUEST)
                if reply:
                    break
                self._channel.close()
                self._channel = None
            else:
                raise OSError("the sandbox spawner process ended")
        answer = json.loads(reply)
        if "error" in answer:
            raise OSError(answer["error"])
        return answer["pid"], answer["start"]


SPAWNER = Spawner()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
