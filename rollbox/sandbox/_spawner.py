"""Starts bwrap processes for the local backend, from a small helper process of their own.

The host process could start bwrap itself, but the child must join the sandbox's cgroups and
drop to the sandbox user before bwrap runs, which takes a ``preexec_fn``. That makes Python
fork rather than vfork: a fork of a trainer holding gigabytes copies its page tables (~50 ms
for 2 GiB, with the GIL held), and ``subprocess`` then blocks until the child has exec'd, which
includes the cgroup moves (each may wait ~10 ms for an RCU grace period). So one small
interpreter per host process (``python -I -S`` of this file, stdlib only) does the forking:
the host sends it a request and the child's pipes over a socket and gets the pid back at once,
without waiting for the child; a child that cannot set itself up says why on its stderr (which
the host reads for its start-up error) and exits 127, never running bwrap.

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


def _become_sandbox(request: dict, fds: list[int]) -> None:
    """In the forked child: take the fds, join the network and cgroups, drop to the user, exec."""
    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(number, signal.SIG_DFL)  # ignored signals would outlive the exec
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in fds]  # out of the way of 0-3
    for target, fd in enumerate(high[:4]):
        os.dup2(fd, target)
    if len(high) > NETNS:  # a failure here aborts the exec: never the host's network
        _setns_net(high[NETNS])
    for path in request["cgroup_procs"]:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)
    limit = request["file_size_limit"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    uid = request["uid"]
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.closerange(4, 1 << 20)
    os.chdir("/")
    argv = request["argv"]
    os.execve(argv[0], argv, {})


def _spawn(request: dict, fds: list[int]) -> dict:
    pid = os.fork()
    if pid == 0:
        try:
            _become_sandbox(request, fds)
        except BaseException as exc:  # anything: report it, never run bwrap
            try:
                os.write(2, f"rollbox: cannot start the sandbox: {exc}\n".encode())
            finally:
                os._exit(127)
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
    channel = socket.socket(fileno=channel_fd)
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
                reply = _spawn(json.loads(message), fds)
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
        file_size_limit: int,
        uid: int,
    ) -> tuple[int, int | None]:
        """Start ``argv`` with ``fds`` (stdin, stdout, stderr, seccomp[, netns]); (pid, start)."""
        request = json.dumps(
            {
                "argv": argv,
                "cgroup_procs": cgroup_procs,
                "file_size_limit": file_size_limit,
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
