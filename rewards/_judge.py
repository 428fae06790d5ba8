"""PythonTests' harness. Runs inside the sandbox: stdlib only, Python 3.8 or newer.

Two processes, so that the code under test never runs where the verdict is made:

- the judge (trusted) runs the test code, e.g. HumanEval's ``check(candidate)``, one statement at
  a time. It makes itself non-dumpable first, so a process of the same uid can neither read its
  memory (the tests, the run's nonce) nor open its file descriptors through ``/proc``.
- the candidate (hostile), a child in its own session, loads the solution and answers calls.
  ``candidate`` in the tests is a proxy: arguments go to it as plain data and the return value
  comes back as plain data (None, bool, int, float, complex, str, bytes, list, tuple, dict, set,
  frozenset), rebuilt by the judge. An object whose ``__eq__`` always says yes therefore compares
  equal to nothing, and monkeypatching builtins, ``sys.modules`` or a test framework changes only
  the candidate's own process. A call that runs out of time kills the candidate; the next call
  starts a fresh one.

The judge is started with ``python3 -I -c BOOTSTRAP`` and reads this file's source from stdin,
then makes itself non-dumpable, imports what solutions commonly use and forks two warm
candidates (no interpreter start-up per candidate), and only then reads the secrets: a JSON line
with the run's nonce and the tests. A candidate needed after those are used up is started from a
fresh interpreter. The judge reports on stdout, one line per event, each prefixed by the nonce
(which no candidate ever holds): ``{"test": i, "passed": ...}`` per test statement,
``{"setup": i, "error": ...}`` for a failing non-test statement, ``{"end": true}``.

The host imports this module too, to number the tests the same way (``plan``).
"""

import ast
import builtins
import contextlib
import json
import os
import select
import signal
import sys
import time

# Reads a 10-digit length, a role letter and exactly that much source, with unbuffered reads:
# nothing after the source (the judge's secrets) is in the process when it forks candidates.
BOOTSTRAP = """import os
def read_exact(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise SystemExit(3)
        data += chunk
    return data
head = read_exact(11)
source = read_exact(int(head[:10])).decode()
exec(compile(source, "<rollbox-judge>", "exec"),
     {"__name__": "__rollbox_judge__", "ROLE": head[10:].decode(), "SOURCE": source})
"""
WARM_CANDIDATES = 2  # forked before the secrets are read; more are started cold (exec)
# What solutions commonly import, loaded once in the judge so that warm candidates have it.
PRELOAD = ("typing", "math", "re", "collections", "itertools", "functools", "string", "heapq")
MESSAGE_LIMIT = 16 * 1024 * 1024  # a reply larger than this fails the call
MAX_DEPTH = 100  # nesting of values passed between the processes
ERROR_CHARS = 300


# -- values across the process boundary ----------------------------------------------------------


def encode(value, depth=0):
    """A JSON-able form of ``value``; subclasses and look-alikes become the plain value they hold."""
    if depth > MAX_DEPTH:
        raise ValueError("the value is nested too deeply")
    if value is None or value is True or value is False:
        return value
    kind = type(value)
    if kind is int or kind is str or kind is float:
        return value
    if kind is list:
        return [encode(item, depth + 1) for item in value]
    if kind is tuple:
        return {"t": [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set:
        return {"s": [encode(item, depth + 1) for item in value]}
    if kind is frozenset:
        return {"z": [encode(item, depth + 1) for item in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    # The base types' own methods read the stored value, whatever the subclass overrides.
    for base, plain in (
        (int, int.__int__),
        (float, float.__float__),
        (str, str.__str__),
        (list, lambda v: list.__getitem__(v, slice(None))),
        (tuple, lambda v: tuple.__getitem__(v, slice(None))),
        (dict, dict.copy),
        (set, set.copy),
        (frozenset, frozenset.copy),
        (bytes, bytes.__bytes__),
    ):
        if isinstance(value, base):
            return encode(plain(value), depth + 1)
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist) and type(value).__module__.split(".")[0] == "numpy":
        return encode(tolist(), depth + 1)
    raise TypeError(
        f"a {kind.__name__} is not plain data (None, bool, int, float, complex, str, bytes, "
        "list, tuple, dict, set, frozenset)"
    )


def decode(data, depth=0):
    """Rebuild a value from ``encode``'s form, accepting nothing else."""
    if depth > MAX_DEPTH:
        raise ValueError("the value is nested too deeply")
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is float or kind is str:
        return data
    if kind is list:
        return [decode(item, depth + 1) for item in data]
    if kind is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2:
            return complex(*(float(part) for part in body if type(part) in (int, float)))
        if type(body) is list:
            items = [decode(item, depth + 1) for item in body]
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "z":
                return frozenset(items)
            if tag == "d" and all(type(pair) is list and len(pair) == 2 for pair in items):
                return {key: value for key, value in items}
    raise ValueError("malformed value from the solution's process")


# -- the tests -------------------------------------------------------------------------------------


def _has_assert(node):
    return any(isinstance(child, ast.Assert) for child in ast.walk(node))


def _describe(source, node, prefix):
    segment = ast.get_source_segment(source, node) or ""
    first = segment.strip().splitlines()[0] if segment.strip() else type(node).__name__
    if len(first) > 80:
        first = first[:77] + "..."
    return f"{prefix}: {first}"


def _is_check_call(node):
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "check"
    )


def plan(tests):
    """How the judge runs ``tests``: ``(module statements, units)``.

    ``tests`` is test code (a ``check(candidate)`` function as in HumanEval, or top-level
    asserts as in MBPP) or a list of test snippets. Each unit is ``(name, is_test, node)``: a
    statement of ``check``'s body (or of the module, without ``check``) that holds an assert is a
    test; the others set up the ones after them. A list gives one test per snippet.
    """
    if isinstance(tests, list):
        units = []
        for number, snippet in enumerate(tests, start=1):
            module = ast.parse(snippet, f"<test {number}>")
            first = (snippet.strip().splitlines() or [""])[0]
            name = f"test {number}: " + (first if len(first) <= 80 else first[:77] + "...")
            units.append((name, True, module))
        return [], units
    module = ast.parse(tests, "<tests>")
    checks = [
        node
        for node in module.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "check"
    ]
    if checks:  # run by statement, so that each assert is a test of its own
        top = [node for node in module.body if not _is_check_call(node)]
        body = checks[-1].body
    else:
        top, body = [], module.body
    units = [
        (
            _describe(tests, node, f"line {node.lineno}"),
            _has_assert(node),
            ast.Module(body=[node], type_ignores=[]),
        )
        for node in body
    ]
    return top, units


def numbered_tests(tests):
    """``[(unit index, name)]`` of the tests ``plan`` finds, in order."""
    return [(index, name) for index, (name, is_test, _) in enumerate(plan(tests)[1]) if is_test]


# -- the judge --------------------------------------------------------------------------------------


class Timeout(BaseException):
    """A test ran out of time (a BaseException, so test code's ``except Exception`` won't eat it)."""


def make_undumpable():
    """No process of our uid may read our memory or open our fds via /proc; False if not done."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except Exception:
        return False


def boot_header(source, role):
    """What the bootstrap reads first: the source's length, a role letter, the source."""
    data = source.encode()
    return b"%010d%s" % (len(data), role.encode()) + data


def fork_warm():
    """A candidate forked now, waiting for its boot line: ``(pid, to_child, from_child)``.

    Called before the judge reads its secrets, so the child never holds them.
    """
    to_child, from_judge = os.pipe()
    from_child, to_judge = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _become_candidate(to_child, to_judge)
            os.closerange(3, 1 << 16)  # nothing of the judge's: its stdin holds the secrets
            serve()
        finally:
            os._exit(127)
    os.close(to_child)
    os.close(to_judge)
    return pid, from_judge, from_child


def _become_candidate(stdin_fd, stdout_fd):
    os.setsid()
    os.dup2(stdin_fd, 0)
    os.dup2(stdout_fd, 1)
    try:  # if the sandbox runs out of memory, the solution goes first
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
    except OSError:
        pass


class Candidate:
    """The solution's process, started on first use and after it dies or times out."""

    def __init__(self, payload, source, warm):
        self.boot = json.dumps(
            {"solution_path": payload["solution_path"], "entry_point": payload["entry_point"]}
        ).encode()
        self.source = source
        self.warm = warm
        self.pid = None
        self.rfd = self.wfd = -1
        self.buffer = b""
        self.deadline = None

    def start(self):
        if self.warm:
            self.pid, self.wfd, self.rfd = self.warm.pop()
            self.buffer = b""
            self._send(self.boot + b"\n")
        else:
            to_child, from_judge = os.pipe()
            from_child, to_judge = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    _become_candidate(to_child, to_judge)
                    os.execv(sys.executable, [sys.executable, "-I", "-c", BOOTSTRAP])
                finally:
                    os._exit(127)
            os.close(to_child)
            os.close(to_judge)
            self.pid, self.wfd, self.rfd, self.buffer = pid, from_judge, from_child, b""
            self._send(boot_header(self.source, "c") + self.boot + b"\n")
        if self._receive() != b"ready":
            self.kill()
            raise RuntimeError("the solution's process did not start")

    def close(self):
        """Kill the candidate and the warm ones never used."""
        self.kill()
        while self.warm:
            self.pid, self.wfd, self.rfd = self.warm.pop()
            self.kill()

    def kill(self):
        if self.pid is None:
            return
        for target in (-self.pid, self.pid):
            with contextlib.suppress(OSError):
                os.kill(target, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(self.pid, 0)
        for fd in (self.rfd, self.wfd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.pid = None

    def _remaining(self):
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.kill()
            raise Timeout()
        return left

    def _send(self, data):
        view = memoryview(data)
        while view:
            if not select.select([], [self.wfd], [], self._remaining())[1]:
                continue
            try:
                written = os.write(self.wfd, view[: 1 << 16])
            except BrokenPipeError:
                self.kill()
                raise RuntimeError("the solution's process exited") from None
            view = view[written:]

    def _receive(self):
        while b"\n" not in self.buffer:
            if not select.select([self.rfd], [], [], self._remaining())[0]:
                continue
            chunk = os.read(self.rfd, 1 << 16)
            if not chunk:
                self.kill()
                raise RuntimeError("the solution's process exited")
            self.buffer += chunk
            if len(self.buffer) > MESSAGE_LIMIT:
                self.kill()
                raise RuntimeError(f"the solution returned more than {MESSAGE_LIMIT} bytes")
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def call(self, args, kwargs):
        request = json.dumps({"args": encode(list(args)), "kwargs": encode(kwargs)})
        if self.pid is None:
            self.start()
        self._send(request.encode() + b"\n")
        try:
            reply = json.loads(self._receive())
        except ValueError:
            self.kill()
            raise RuntimeError("the solution's process sent garbage") from None
        if type(reply) is not dict:
            raise RuntimeError("the solution's process sent garbage")
        if "ok" in reply:
            return decode(reply["ok"])
        kind = getattr(builtins, str(reply.get("raise")), None)
        message = str(reply.get("message", ""))[:ERROR_CHARS]
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(message)
        raise RuntimeError("{}: {}".format(reply.get("raise"), message))


def judge(source):
    undumpable = make_undumpable()
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    warm = [fork_warm() for _ in range(WARM_CANDIDATES)]
    payload = json.loads(sys.stdin.readline())  # the secrets: read only now
    nonce = payload["nonce"]

    def emit(record):
        sys.stdout.write(nonce + " " + json.dumps(record) + "\n")
        sys.stdout.flush()

    if not undumpable:
        emit({"warning": "prctl(PR_SET_DUMPABLE, 0) failed: the judge is readable via /proc"})
    candidate = Candidate(payload, source, warm)
    entry_point = payload["entry_point"]

    def proxy(*args, **kwargs):
        return candidate.call(args, kwargs)

    proxy.__name__ = proxy.__qualname__ = entry_point
    namespace = {"__name__": "__tests__", "__builtins__": builtins}
    top, units = plan(payload["tests"])
    budget = payload["test_timeout_seconds"]
    context = payload.get("context")
    candidate.deadline = time.monotonic() + budget
    try:
        if context:  # e.g. HumanEval's prompt: helpers that the tests call
            exec(compile(context, "<context>", "exec"), namespace)
        namespace[entry_point] = namespace["candidate"] = proxy
        exec(compile(ast.Module(body=top, type_ignores=[]), "<tests>", "exec"), namespace)
    except BaseException as exc:  # the task's own code failed: no test can run
        emit({"error": f"the test setup failed: {_error(exc)}"})
        candidate.kill()
        return
    namespace[entry_point] = namespace["candidate"] = proxy
    for index, (_, is_test, node) in enumerate(units):
        candidate.deadline = time.monotonic() + budget
        error = None
        try:
            exec(compile(node, "<tests>", "exec"), namespace)
        except Timeout:
            error = f"timed out after {budget:g} s"
        except BaseException as exc:
            error = _error(exc)
        if is_test:
            emit({"test": index, "passed": error is None, "error": error})
        elif error is not None:
            emit({"setup": index, "error": error})
    candidate.close()
    emit({"end": True})


def _message(exc):
    try:
        return str(exc)[:ERROR_CHARS]
    except BaseException:
        return ""


def _error(exc):
    try:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except Exception:
        text = type(exc).__name__
    return text[:ERROR_CHARS]


# -- the candidate ------------------------------------------------------------------------------------


def serve():
    # The protocol moves off fds 0 and 1, so the solution's prints go to stderr, not to the judge.
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    os.close(null)
    reader = os.fdopen(rfd, "rb")
    boot = json.loads(reader.readline())
    path, entry_point = boot["solution_path"], boot["entry_point"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.argv = [path]
    namespace = {"__name__": "solution", "__file__": path, "__builtins__": builtins}
    failure = None
    try:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        exec(compile(source, path, "exec"), namespace)
    except BaseException as exc:
        failure = "loading the solution failed: " + _error(exc)
    function = namespace.get(entry_point)
    if failure is None and not callable(function):
        failure = f"the solution defines no function {entry_point!r}"
    _write_all(wfd, b"ready\n")
    for line in reader:
        if failure is not None:
            reply = {"raise": "RuntimeError", "message": failure}
        else:
            try:
                request = json.loads(line)
                value = function(*decode(request["args"]), **decode(request["kwargs"]))
                reply = {"ok": encode(value)}
            except BaseException as exc:
                reply = {"raise": type(exc).__name__, "message": _message(exc)}
        try:
            data = json.dumps(reply).encode() + b"\n"
        except BaseException as exc:
            data = json.dumps({"raise": "ValueError", "message": _error(exc)}).encode() + b"\n"
        _write_all(wfd, data)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


if __name__ == "__rollbox_judge__":
    if ROLE == "j":  # noqa: F821 - given by the bootstrap
        judge(SOURCE)  # noqa: F821
    else:
        serve()
