"""The agent: PID 1 of a local sandbox. Stdlib only; runs under ``python3 -I -S``.

It serves the host over its stdin/stdout with framed messages: a ``>II`` header (JSON length,
body length), the JSON, then the body bytes. It runs commands (each in its own session and, when
the host lends one, its own pids cgroup, so a timeout kills every process the command started,
setsid'd and double-forked ones included), keeps their output up to a cap, and does file
operations. Being inside the sandbox, every path it touches resolves in the sandbox's own mount
namespace: symlinks made by sandboxed code can never reach a host file. As PID 1 of the pid
namespace, it cannot be signalled by sandboxed code, and when it exits the kernel kills every
process in the sandbox.

Where the host lends no cgroup (a Docker container), each command runs under a forked child of
the agent that is a subreaper (``PR_SET_CHILD_SUBREAPER``): orphans of the command, setsid'd and
double-forked ones included, are re-parented to it rather than to PID 1, so the command's whole
tree stays reachable through parent links while the command runs; a timeout stops that tree
(SIGSTOP, so nothing forks while it is walked) and then kills it. The agent also makes itself
non-dumpable there, so sandboxed code running as the same uid cannot ptrace it.
"""

# The agent starts with every sandbox, so it imports only C modules. ``os`` is the ``posix``
# module plus os.path, os.walk and friends, which pull in collections.abc and posixpath: ~1.3 ms
# of every start. ``struct`` is a wrapper of ``_struct``.
import _struct as struct
import _thread
import errno
import posix as os
import select
import stat
import sys
import time

# Likewise the ``signal`` and ``json`` packages pull in ``enum`` and ``re`` (~5 ms of every
# start): their C halves do the work.
try:
    import _signal as signal
except ImportError:  # not CPython
    import signal
try:
    from _json import encode_basestring_ascii as quote
    from _json import make_scanner
except ImportError:  # not CPython
    quote = make_scanner = None

HEADER = struct.Struct(">II")
OOM_SCORE_FD = -1  # /proc/self/oom_score_adj, opened in main()
CHUNK = 65536
RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT)
AFTER_EXIT_GRACE = 0.05  # seconds to wait for a finished command's pipes to reach EOF
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
RLIMIT_FSIZE = 1


class JSONContext:
    """What json's C scanner reads from a decoder: the settings of ``json.loads``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity


def to_json(value):
    """``json.dumps(value, separators=(",", ":"))`` for the types the agent sends."""
    if isinstance(value, str):
        return quote(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join([to_json(item) for item in value]) + "]"
    if isinstance(value, dict):
        return "{" + ",".join([quote(k) + ":" + to_json(v) for k, v in value.items()]) + "}"
    raise TypeError("cannot encode %r" % (type(value),))


if make_scanner is not None:
    scan = make_scanner(JSONContext())

    def dumps(value):
        return to_json(value).encode()

    def loads(data):
        text = data.decode().strip(" \t\n\r")
        try:
            value, end = scan(text, 0)
        except StopIteration:
            raise ValueError("invalid JSON") from None
        if end != len(text):
            raise ValueError("extra data after JSON")
        return value

else:
    import json

    def dumps(value):
        return json.dumps(value, separators=(",", ":")).encode()

    loads = json.loads


class Command:
    def __init__(self, cid, limit, stream):
        self.cid = cid
        self.limit = limit
        self.stream = stream
        self.pid = 0
        self.cgroup = None
        self.fds = {}  # fd -> stream index (0 stdout, 1 stderr)
        self.out = [bytearray(), bytearray()]
        self.truncated = False
        self.deadline = None
        self.timed_out = False
        self.status = None
        self.exited_at = None
        self.started = time.monotonic()
        self.stdin_fd = -1
        self.stdin_data = b""
        self.finished = False
        self.reaper = False  # pid is a subreaper that runs the shell (no cgroup here)


class Agent:
    def __init__(self, rfd, wfd, cgroup_root, prctl=None):
        self.rfd = rfd
        self.wfd = wfd
        self.cgroup_root = cgroup_root
        self.prctl = prctl  # set where commands run under a subreaper (no cgroup)
        self.inbuf = bytearray()
        self.commands = {}  # cid -> Command
        self.by_pid = {}  # pid -> Command
        self.fd_owner = {}  # fd -> Command (reading its output)
        self.stdin_owner = {}  # fd -> Command (writing its stdin)
        self.draining = set()  # fds of finished commands, read and discarded until EOF
        self.lingering = set()  # cgroups of finished commands that still had processes
        self.known_cgroups = set()  # the command cgroups this agent made
        self.cgroup_serial = 0
        self.next_cgroup = None  # made for the next command; the agent moves in ahead of it
        self.next_joined = False
        self.next_moving = _thread.allocate_lock()  # held while the move is under way
        self.ttl_deadline = None
        self.poll = select.epoll()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_r = wake_r
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.poll.register(rfd, select.EPOLLIN)
        self.poll.register(wake_r, select.EPOLLIN)
        if cgroup_root:
            self.prepare_next_cgroup()

    # -- messages --------------------------------------------------------------------------

    def send(self, header, body=b""):
        data = dumps(header)
        view = memoryview(HEADER.pack(len(data), len(body)) + data + body)
        while view:
            try:
                view = view[os.write(self.wfd, view) :]
            except InterruptedError:
                continue

    def error(self, rid, code, message):
        self.send({"op": "err", "rid": rid, "code": code, "msg": message})

    def read_requests(self):
        try:
            data = os.read(self.rfd, 1 << 20)
        except InterruptedError:
            return
        if not data:
            os._exit(0)  # the host is gone: end the sandbox
        self.inbuf += data
        while len(self.inbuf) >= HEADER.size:
            hlen, blen = HEADER.unpack_from(self.inbuf)
            end = HEADER.size + hlen + blen
            if len(self.inbuf) < end:
                return
            header = loads(bytes(self.inbuf[HEADER.size : HEADER.size + hlen]))
            body = bytes(self.inbuf[HEADER.size + hlen : end])
            del self.inbuf[:end]
            self.dispatch(header, body)

    def dispatch(self, req, body):
        op = req.get("op")
        rid = req.get("rid")
        try:
            if op == "exec":
                self.start_command(req, body)
            elif op == "kill":
                command = self.commands.get(req["cid"])
                if command is not None and command.status is None:
                    self.kill_tree(command)
                self.send({"op": "ok", "rid": rid})
            elif op == "logs":
                command = self.commands.get(req["cid"])
                out = command.out if command else [b"", b""]
                self.send(
                    {"op": "ok", "rid": rid, "n1": len(out[0])}, bytes(out[0]) + bytes(out[1])
                )
            elif op == "write":
                self.write_file(req["path"], body, req.get("mode", 0o644))
                self.send({"op": "ok", "rid": rid})
            elif op == "read":
                self.send({"op": "ok", "rid": rid}, self.read_file(req["path"], req["limit"]))
            elif op == "list":
                self.send({"op": "ok", "rid": rid, "entries": self.list_dir(req["path"])})
            elif op == "remove":
                self.remove(req["path"], req.get("recursive", False))
                self.send({"op": "ok", "rid": rid})
            elif op == "ttl":
                seconds = req.get("seconds")
                self.ttl_deadline = None if seconds is None else time.monotonic() + seconds
                self.send({"op": "ok", "rid": rid})
            elif op == "killall":
                self.send({"op": "ok", "rid": rid, "survivors": self.kill_all()})
            elif op == "ping":
                self.send({"op": "ok", "rid": rid})
            elif op == "capture":
                self.capture(rid, req["paths"], req.get("scan_root", False))
                self.send({"op": "ok", "rid": rid})
            else:
                self.error(rid, "bad_request", "unknown op %r" % (op,))
        except OSError as exc:
            code = {
                errno.ENOENT: "not_found",
                errno.EISDIR: "is_dir",
                errno.ENOTDIR: "not_dir",
                errno.EACCES: "permission",
                errno.EPERM: "permission",
                errno.EROFS: "read_only",
                errno.ENOSPC: "no_space",
                errno.EFBIG: "too_big",
                errno.EDQUOT: "no_space",
                errno.ENOTEMPTY: "not_empty",
                errno.EEXIST: "exists",
                errno.ELOOP: "loop",
                errno.ENODEV: "not_regular",
                errno.ENXIO: "not_regular",
            }.get(exc.errno, "os_error")
            self.error(
                rid, code, "%s: %s" % (exc.strerror or exc, req.get("path", req.get("cwd", "")))
            )
        except Exception as exc:  # keep serving whatever one request did
            self.error(rid, "internal", "%s: %s" % (type(exc).__name__, exc))

    # -- files -----------------------------------------------------------------------------

    def write_file(self, path, data, mode):
        make_dirs(path.rpartition("/")[0])
        # O_NONBLOCK and no O_TRUNC until we know it is a regular file: a FIFO or device planted
        # by sandboxed code must not block this single-threaded agent or be written to.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, mode)
        try:
            self.require_regular(fd)
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def read_file(self, path, limit):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.require_regular(fd)
            os.set_blocking(fd, True)
            chunks = []
            size = 0
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > limit:  # e.g. a /proc file that never ends
                    raise OSError(errno.EFBIG, "File larger than the read limit")
                chunks.append(chunk)
        finally:
            os.close(fd)

    def require_regular(self, fd):
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        if not stat.S_ISREG(mode):
            raise OSError(errno.ENODEV, "Not a regular file (a FIFO, socket or device)")

    def list_dir(self, path):
        entries = []
        with os.scandir(path) as listing:
            for entry in listing:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                mode = st.st_mode
                kind = (
                    "symlink"
                    if stat.S_ISLNK(mode)
                    else "dir"
                    if stat.S_ISDIR(mode)
                    else "file"
                    if stat.S_ISREG(mode)
                    else "other"
                )
                entries.append([entry.name, kind, st.st_size, stat.S_IMODE(mode), st.st_mtime])
        entries.sort()
        return entries

    def remove(self, path, recursive):
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return
        if not recursive:
            raise OSError(errno.EISDIR, "Is a directory (pass recursive=True)", path)
        remove_tree(path)

    # -- snapshots -------------------------------------------------------------------------

    def capture(self, rid, paths, scan_root):
        """Stream a tar of ``paths`` (and of what this uid owns elsewhere in the root).

        Members are named ``<top>/<relative path>`` (``work/...``, ``root/...``). Symlinks are
        stored as symlinks, never followed; sockets, fifos and devices are skipped. A directory
        owned by this uid outside ``paths`` is stored whole and marked opaque (pax header
        ``ROLLBOX.opaque``), so a sandbox started from the snapshot sees exactly its content.
        """
        import tarfile

        agent = self

        class Chunks:
            def write(self, data):
                if data:
                    agent.send({"op": "chunk", "rid": rid}, bytes(data))
                return len(data)

        with tarfile.open(
            fileobj=Chunks(), mode="w|", format=tarfile.PAX_FORMAT, bufsize=1 << 20
        ) as tar:
            for path in paths:
                self.add_tree(tar, path, path.strip("/").replace("/", "_"), False)
            if scan_root:
                self.add_owned(tar, "/", set(paths) | {"/proc", "/dev", "/sys", "/.rollbox"})

    def add_owned(self, tar, directory, skip):
        uid = os.getuid()
        try:
            with os.scandir(directory) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError:
            return
        for entry in entries:
            if entry.path in skip:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                self.add_tree(tar, entry.path, "root" + entry.path, True)
            elif stat.S_ISDIR(st.st_mode):
                self.add_owned(tar, entry.path, skip)

    def add_tree(self, tar, path, name, opaque):
        """Add ``path`` as ``name``; a directory with everything under it."""
        import tarfile

        try:
            st = os.lstat(path)
        except OSError:
            return
        info = tarfile.TarInfo(name)
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.uid, info.gid = st.st_uid, st.st_gid
        if stat.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
            try:
                info.linkname = os.readlink(path)
            except OSError:
                return
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):  # swapped for a FIFO since the lstat
                    return
                info.size = st.st_size
                tar.addfile(info, SizedReader(fd, info.size))
            finally:
                os.close(fd)
        elif stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            if opaque:
                info.pax_headers = {"ROLLBOX.opaque": "1"}
            tar.addfile(info)
            try:
                names = sorted(os.listdir(path))
            except OSError:
                names = []
            for child in names:
                self.add_tree(tar, path.rstrip("/") + "/" + child, name + "/" + child, False)

    # -- commands --------------------------------------------------------------------------

    def start_command(self, req, stdin_data):
        cid = req["rid"]
        cwd = req["cwd"]
        if not is_dir(cwd):
            self.error(cid, "bad_cwd", "working directory %s does not exist in the sandbox" % cwd)
            return
        command = Command(cid, req["limit"], req.get("stream", False))
        if req.get("timeout") is not None:
            command.deadline = time.monotonic() + req["timeout"]
        if self.cgroup_root:
            command.cgroup = self.take_next_cgroup()
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        if req.get("stdin"):
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
        else:
            in_r, in_w = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC), -1
        # posix_spawn (vfork) is far cheaper than fork here. The child inherits the agent's cwd
        # and cgroup: the agent is already in the command's cgroup, and steps into its cwd around
        # the spawn, so the command starts inside both, before it can fork anything.
        try:
            os.chdir(cwd)
            # Commands are the OOM killer's first choice, the agent its last: files in the
            # sandbox's tmpfs count against its memory but belong to no process. (Raising is
            # allowed unprivileged; lowering back only to the value we started with.)
            self.set_oom_score(b"1000")
            if self.prctl is not None and not command.cgroup:
                pid = self.spawn_under_reaper(req["cmd"], req["env"], in_r, out_w, err_w)
                command.reaper = True
            else:
                pid = spawn_command(req["cmd"], req["env"], in_r, out_w, err_w)
        finally:
            self.set_oom_score(b"0")
            os.chdir("/")
            if self.cgroup_root:
                self.prepare_next_cgroup()
        os.close(in_r)
        os.close(out_w)
        os.close(err_w)
        command.pid = pid
        self.commands[cid] = command
        self.by_pid[pid] = command
        for fd, index in ((out_r, 0), (err_r, 1)):
            os.set_blocking(fd, False)
            command.fds[fd] = index
            self.fd_owner[fd] = command
            self.poll.register(fd, select.EPOLLIN)
        if in_w >= 0:
            os.set_blocking(in_w, False)
            command.stdin_fd = in_w
            command.stdin_data = memoryview(stdin_data)
            self.stdin_owner[in_w] = command
            self.poll.register(in_w, select.EPOLLOUT)
        self.send({"op": "started", "rid": cid, "pid": pid})
        self.sweep_lingering()

    def feed_stdin(self, fd):
        command = self.stdin_owner[fd]
        try:
            written = os.write(fd, command.stdin_data[:CHUNK])
            command.stdin_data = command.stdin_data[written:]
        except BlockingIOError:
            return
        except OSError:  # EPIPE: the command closed its stdin
            command.stdin_data = b""
        if not command.stdin_data:
            self.close_stdin(command)

    def close_stdin(self, command):
        if command.stdin_fd >= 0:
            self.poll.unregister(command.stdin_fd)
            del self.stdin_owner[command.stdin_fd]
            os.close(command.stdin_fd)
            command.stdin_fd = -1

    def read_output(self, fd):
        if fd in self.draining:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.poll.unregister(fd)
                os.close(fd)
                self.draining.discard(fd)
            return
        command = self.fd_owner[fd]
        index = command.fds[fd]
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.poll.unregister(fd)
            os.close(fd)
            del command.fds[fd]
            del self.fd_owner[fd]
            self.maybe_finish(command)
            return
        buffer = command.out[index]
        room = command.limit - len(buffer)
        if room < len(data):
            command.truncated = True
            data = data[: max(room, 0)]
        if data:
            buffer += data
            if command.stream:
                self.send({"op": "out", "cid": command.cid, "s": index + 1}, data)

    def reap(self):
        try:
            while os.read(self.wake_r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            command = self.by_pid.pop(pid, None)
            if command is None:
                continue  # an orphan adopted by PID 1
            command.status = os.waitstatus_to_exitcode(status)
            command.exited_at = time.monotonic()
            self.close_stdin(command)
            self.maybe_finish(command)

    def maybe_finish(self, command, force=False):
        if command.finished or command.status is None:
            return
        if command.fds and not force:
            return  # wait for EOF, or for the grace period in tick()
        command.finished = True
        for fd in list(command.fds):
            del self.fd_owner[fd]
            self.draining.add(fd)  # a background child still holds the pipe: keep draining it
        command.fds.clear()
        stdout, stderr = bytes(command.out[0]), bytes(command.out[1])
        self.send(
            {
                "op": "exit",
                "cid": command.cid,
                "code": command.status,
                "timed_out": command.timed_out,
                "truncated": command.truncated,
                "duration": time.monotonic() - command.started,
                "n1": len(stdout),
            },
            stdout + stderr,
        )
        if command.cgroup and not self.try_rmdir(command.cgroup):
            self.lingering.add(command.cgroup)
        # keep the record for logs() until the host forgets it; output is small and capped
        del self.commands[command.cid]

    def set_oom_score(self, value):
        if OOM_SCORE_FD >= 0:
            try:
                os.write(OOM_SCORE_FD, value)
            except OSError:
                pass

    def prepare_next_cgroup(self):
        """Make the next command's cgroup and move the agent into it, in the background.

        A move between cgroups waits for an RCU grace period (~10 ms) unless another move
        happened just before, so a command that paid it would start late after every pause.
        Done ahead, it is off the command's path. Until the move is done the agent stays in the
        cgroup of the command it last started (``kill_cgroup`` spares PID 1).
        """
        self.cgroup_serial += 1
        path = "%s/n%d" % (self.cgroup_root, self.cgroup_serial)
        try:
            os.mkdir(path)
        except OSError:
            self.next_cgroup = None
            return
        self.known_cgroups.add(path)
        self.next_cgroup = path
        self.next_joined = False
        self.next_moving.acquire()
        try:
            _thread.start_new_thread(self.move_ahead, (path,))
        except RuntimeError:  # no thread to be had (the pids limit is reached): move now
            self.move_ahead(path)

    def move_ahead(self, path):
        try:
            self.join_cgroup(path)
            self.next_joined = True
        except OSError:
            pass
        finally:
            self.next_moving.release()

    def take_next_cgroup(self):
        """The cgroup the agent is in, made for this command (None if none could be made)."""
        for _ in range(2):  # the second time synchronously, should the first have failed
            with self.next_moving:  # wait for a move still under way
                pass
            path, self.next_cgroup = self.next_cgroup, None
            if path is not None and self.next_joined:
                self.kill_cgroup(path)  # a stray that moved itself in while it waited
                return path
            if path is not None:
                self.try_rmdir(path)
            self.prepare_next_cgroup()
        return None

    def join_cgroup(self, cgroup):
        fd = os.open(cgroup + "/cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def spawn_under_reaper(self, cmd, env, in_r, out_w, err_w):
        """Fork a subreaper that runs ``/bin/sh -c cmd`` and exits with its status."""
        pid = os.fork()
        if pid:
            return pid
        try:  # the child: never returns
            signal.set_wakeup_fd(-1)
            for signum in RESET_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            os.setsid()
            self.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 1 << 16)
            shell = os.posix_spawn("/bin/sh", ["/bin/sh", "-c", cmd], env, setsigmask=())
            while True:
                child, status = os.waitpid(-1, 0)
                if child == shell:
                    break
            code = os.waitstatus_to_exitcode(status)
            if code < 0:  # died of a signal: so does this process, for the agent to see
                os.kill(os.getpid(), -code)
            os._exit(code & 0xFF)
        except BaseException:
            os._exit(127)

    def descendants(self, root):
        """Live (non-zombie) descendants of ``root``, from the parent links in /proc."""
        children = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % name, "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] not in (b"Z", b"X"):
                children.setdefault(int(fields[1]), []).append(int(name))
        found = []
        pending = [root]
        while pending:
            for child in children.get(pending.pop(), ()):
                found.append(child)
                pending.append(child)
        return found

    def kill_reaped_tree(self, command):
        """Stop the subreaper's whole tree until no new process shows up, then kill it all."""
        stopped = set()
        for _ in range(200):
            new = [pid for pid in self.descendants(command.pid) if pid not in stopped]
            if not new:
                break
            for pid in new:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except OSError:
                    pass
                stopped.add(pid)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def kill_tree(self, command):
        """Kill every process the command started; its cgroup catches setsid'd orphans."""
        if command.reaper:
            self.kill_reaped_tree(command)
        try:
            os.killpg(command.pid, signal.SIGKILL)
        except OSError:
            pass
        if command.cgroup:
            self.kill_cgroup(command.cgroup)
        self.kill_strays()

    def kill_strays(self):
        """Kill processes that left their command's cgroup to escape a timeout.

        Sandboxed code runs as the same user as this agent, so it can move itself into the
        sandbox's root cgroup or into one it made. Nothing legitimate lives there: every command
        starts inside its own cgroup.
        """
        if not self.cgroup_root:
            return
        try:
            with open(self.cgroup_root + "/cgroup.procs") as procs:
                strays = [int(pid) for pid in procs.read().split() if pid != "1"]
        except (OSError, ValueError):
            strays = []
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for path in sub_dirs(self.cgroup_root):
            if path == self.next_cgroup:
                self.kill_cgroup(path)  # no command runs there yet
            elif path not in self.known_cgroups:
                self.kill_cgroup(path)
                self.try_rmdir(path)

    def kill_all(self):
        """Kill every process but this one (PID 1); how many non-zombies are left (0 on success).

        kill(-1) from a namespace's init reaches every other process in it, and needs no fork,
        so it works even when the sandbox's pids limit is exhausted.
        """
        alive = 0
        for _ in range(500):
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            self.reap()
            alive = 0
            for name in os.listdir("/proc"):
                if name.isdigit() and name != "1":
                    try:
                        with open("/proc/%s/stat" % name, "rb") as handle:
                            state = handle.read().rsplit(b")", 1)[1].split()[0]
                    except (OSError, IndexError):
                        continue
                    if state not in (b"Z", b"X"):
                        alive += 1
            if not alive:
                return 0
            time.sleep(0.001)
        return alive

    def kill_cgroup(self, cgroup):
        for _ in range(200):
            try:
                with open(cgroup + "/cgroup.procs") as procs:
                    pids = [int(line) for line in procs.read().split() if line != "1"]
            except (OSError, ValueError):
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.001)

    def try_rmdir(self, cgroup):
        try:
            os.rmdir(cgroup)
            self.known_cgroups.discard(cgroup)
            return True
        except OSError:
            return False

    def sweep_lingering(self):
        for cgroup in list(self.lingering):
            if self.try_rmdir(cgroup):
                self.lingering.discard(cgroup)

    def tick(self):
        now = time.monotonic()
        if self.ttl_deadline is not None and now >= self.ttl_deadline:
            os._exit(0)
        for command in list(self.commands.values()):
            if command.deadline is not None and now >= command.deadline and command.status is None:
                command.timed_out = True
                command.deadline = None
                self.kill_tree(command)
            if command.status is not None and now - command.exited_at >= AFTER_EXIT_GRACE:
                self.maybe_finish(command, force=True)

    def next_timeout(self):
        deadlines = [self.ttl_deadline] if self.ttl_deadline is not None else []
        for command in self.commands.values():
            if command.deadline is not None and command.status is None:
                deadlines.append(command.deadline)
            if command.status is not None:
                deadlines.append(command.exited_at + AFTER_EXIT_GRACE)
        if not deadlines:
            return 1.0 if self.lingering else -1
        return max(0.0, min(deadlines) - time.monotonic())

    def serve(self):
        self.send({"op": "ready"})
        while True:
            try:
                events = self.poll.poll(self.next_timeout())
            except InterruptedError:
                events = []
            for fd, _mask in events:
                if fd == self.rfd:
                    self.read_requests()
                elif fd == self.wake_r:
                    self.reap()
                elif fd in self.stdin_owner:
                    self.feed_stdin(fd)
                elif fd in self.fd_owner or fd in self.draining:
                    self.read_output(fd)
            self.reap()
            self.tick()
            if self.lingering and not events:
                self.sweep_lingering()


class SizedReader:
    """A file read as exactly ``size`` bytes: cut if it grew, zero-padded if it shrank."""

    def __init__(self, fd, size):
        self.fd = fd
        self.left = size

    def read(self, n=-1):
        if n < 0 or n > self.left:
            n = self.left
        data = b""
        while len(data) < n:
            try:
                chunk = os.read(self.fd, n - len(data))
            except OSError:
                chunk = b""
            if not chunk:
                data += bytes(n - len(data))
                break
            data += chunk
        self.left -= n
        return data


# Characters that mean nothing to sh outside quotes: a command of such words, separated by single
# spaces, is one sh would only split, look up in PATH and exec (dash execs the last command of
# ``-c`` in place, without a fork).
PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:=+,%@-")
# What sh would not look up in PATH: its keywords and builtins (dash's and bash's).
SHELL_WORDS = frozenset((
    "!", "{", "}", "[", "[[", "]]", ".", ":", "alias", "bg", "bind", "break", "builtin", "caller",
    "case", "cd", "command", "compgen", "complete", "continue", "declare", "dirs", "disown", "do",
    "done", "echo", "elif", "else", "enable", "esac", "eval", "exec", "exit", "export", "false",
    "fc", "fg", "fi", "for", "function", "getopts", "hash", "help", "history", "if", "in", "jobs",
    "kill", "let", "local", "logout", "mapfile", "popd", "printf", "pushd", "pwd", "read",
    "readarray", "readonly", "return", "select", "set", "shift", "shopt", "source", "suspend",
    "test", "then", "time", "times", "trap", "true", "type", "typeset", "ulimit", "umask",
    "unalias", "unset", "until", "wait", "while",
))  # fmt: skip


def spawn_command(cmd, env, stdin_fd, stdout_fd, stderr_fd):
    """Start ``cmd`` as ``/bin/sh -c`` would, in a new session; its pid.

    A plain command (see PLAIN) is exec'd directly, as sh would after splitting it, with the PWD
    sh would export: one exec of sh less (~1 ms). Anything else, or a direct exec that fails
    (not found, a script without #!), goes to sh, which does and says exactly what it does.
    """
    spawn = {
        "file_actions": [
            (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
            (os.POSIX_SPAWN_DUP2, stdout_fd, 1),
            (os.POSIX_SPAWN_DUP2, stderr_fd, 2),
        ],
        "setsid": True,
        "setsigdef": RESET_SIGNALS,
        "setsigmask": (),
    }
    argv = cmd.split(" ")
    if "" not in argv and PLAIN.issuperset(cmd.replace(" ", "")) and "PWD" not in env:
        name = argv[0]
        if "=" not in name and name not in SHELL_WORDS:
            program = find_program(name, env.get("PATH", ""))
            if program is not None:
                try:
                    return os.posix_spawn(program, argv, {**env, "PWD": os.getcwd()}, **spawn)
                except OSError:
                    pass
    return os.posix_spawn("/bin/sh", ["/bin/sh", "-c", cmd], env, **spawn)


def find_program(name, path):
    """The file sh would exec for ``name``: itself if it has a /, else the first in PATH."""
    if "/" in name:
        return name
    for directory in path.split(":"):
        candidate = (directory or ".") + "/" + name
        try:
            if stat.S_ISREG(os.stat(candidate).st_mode) and os.access(candidate, os.X_OK):
                return candidate
        except OSError:
            continue
    return None


def is_dir(path):
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def make_dirs(path):
    """os.makedirs(path, exist_ok=True)."""
    if not path or is_dir(path):
        return
    make_dirs(path.rpartition("/")[0])
    try:
        os.mkdir(path)
    except FileExistsError:
        if not is_dir(path):
            raise


def sub_dirs(path):
    """The directories under ``path``, parents before children (symlinks are not followed).

    One that is gone by the time it is listed (the caller removed it) is skipped, as os.walk does.
    """
    try:
        with os.scandir(path) as entries:
            found = [entry.path for entry in entries if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for child in found:
        yield child
        yield from sub_dirs(child)


def remove_tree(path):
    """Remove a directory and everything under it; symlinks are removed, never followed."""
    with os.scandir(path) as entries:
        children = [(entry.path, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for child, directory in children:
        if directory:
            remove_tree(child)
        else:
            os.unlink(child)
    os.rmdir(path)


def libc_function(name):
    """A libc function through _ctypes alone: the ctypes package would cost ~3 ms of every start."""
    import _ctypes

    class Int(_ctypes._SimpleCData):
        _type_ = "i"

    class Function(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int

    class Libc:
        _handle = _ctypes.dlopen(None)

    return Function((name, Libc()))


def limit_file_size(limit):
    """RLIMIT_FSIZE of ``limit`` bytes, soft and hard, for the agent and every command."""
    import _ctypes

    class ULong(_ctypes._SimpleCData):
        _type_ = "L"

    class Rlimit(_ctypes.Array):
        _type_ = ULong
        _length_ = 2

    return libc_function("setrlimit")(RLIMIT_FSIZE, _ctypes.byref(Rlimit(limit, limit))) == 0


def main():
    # Writes past RLIMIT_FSIZE must fail with EFBIG here, not kill the agent.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    rfd = os.dup(0)  # os.dup makes non-inheritable copies: commands never see the protocol
    wfd = os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    cgroup_root = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
    # Set here rather than by whoever starts bwrap: that one cannot raise its own limit back.
    if len(sys.argv) > 2 and not limit_file_size(int(sys.argv[2])):
        os._exit(70)
    global OOM_SCORE_FD
    # Opened while still dumpable: afterwards /proc/self belongs to root, and the agent must
    # still set each command's OOM score.
    try:
        OOM_SCORE_FD = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        OOM_SCORE_FD = -1
    prctl = libc_function("prctl")
    # Not dumpable: sandboxed code runs as our uid, and would otherwise read our memory (the
    # hidden tests and nonces that pass through it) or write to our fds via /proc/1.
    if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        os._exit(70)
    Agent(rfd, wfd, cgroup_root, prctl if cgroup_root is None else None).serve()


if __name__ == "__main__":
    main()
