"""Privilege: no capabilities, no new namespaces, no mounts, no tracing, no dangerous syscalls."""

from __future__ import annotations

import json
import platform

import pytest
from _attack_helpers import (
    PIDS,
    assert_answers,
    assert_no_leftovers,
    cgroup_file,
    new_sandbox,
    sh,
)

from rollbox.sandbox import _host

ARCH = platform.machine()

# Raw syscalls through ctypes, so that no missing tool (or a tool's own fallback) hides the
# kernel's answer. Each prints {name: "OK" | errno name}.
PROBE = r"""
import ctypes, errno, json, os, platform
libc = ctypes.CDLL(None, use_errno=True)
NR = {
    "x86_64": dict(clone=56, ptrace=101, mount=165, unshare=272, setns=308, keyctl=250,
                   bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425,
                   open_by_handle_at=304, kexec_load=246, init_module=175, fsopen=430,
                   process_vm_readv=310, pivot_root=155, setuid=105),
    "aarch64": dict(clone=220, ptrace=117, mount=40, unshare=97, setns=268, keyctl=219,
                    bpf=280, perf_event_open=241, userfaultfd=282, io_uring_setup=425,
                    open_by_handle_at=265, kexec_load=104, init_module=105, fsopen=430,
                    process_vm_readv=270, pivot_root=41, setuid=146),
}[platform.machine()]

def call(name, *args):
    ctypes.set_errno(0)
    result = libc.syscall(NR[name], *[ctypes.c_long(a) for a in args])
    if result == -1:
        return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    return result

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
SIGCHLD = 17
out = {}
for label, flags in [("user", CLONE_NEWUSER), ("mnt", CLONE_NEWNS), ("net", CLONE_NEWNET),
                     ("pid", CLONE_NEWPID), ("user+mnt", CLONE_NEWUSER | CLONE_NEWNS)]:
    result = call("unshare", flags)
    out["unshare " + label] = "OK" if result == 0 else result
    # clone(2) with the same flags, as a fork: the one a seccomp filter on unshare misses.
    result = call("clone", flags | SIGCHLD, 0, 0, 0, 0)
    if result == 0:
        os._exit(0)  # the child of a clone that should not have worked
    if isinstance(result, int):
        os.waitpid(result, 0)
        result = "OK"
    out["clone " + label] = result
sleeper = os.fork()
if sleeper == 0:
    import time
    time.sleep(60)
    os._exit(0)
out["ptrace attach"] = call("ptrace", 16, sleeper, 0, 0)   # PTRACE_ATTACH a sibling
out["ptrace seize"] = call("ptrace", 0x4206, sleeper, 0, 0)  # PTRACE_SEIZE
out["ptrace traceme"] = call("ptrace", 0, 0, 0, 0)
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
out["process_vm_readv"] = call("process_vm_readv", sleeper, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0)
os.kill(sleeper, 9)
os.waitpid(sleeper, 0)
out["mount tmpfs"] = call("mount", ctypes.addressof(ctypes.create_string_buffer(b"none")),
                          ctypes.addressof(ctypes.create_string_buffer(b"/work")),
                          ctypes.addressof(ctypes.create_string_buffer(b"tmpfs")), 0, 0)
out["setns"] = call("setns", os.open("/proc/self/ns/mnt", os.O_RDONLY), 0)
for name in ["keyctl", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
             "open_by_handle_at", "kexec_load", "init_module", "fsopen", "pivot_root"]:
    out[name] = call(name, 0, 0, 0, 0, 0)
out["setuid 0"] = call("setuid", 0)
print(json.dumps(out))
"""

# The syscalls rollbox's seccomp filter fails with EPERM (the kernel alone would often say
# EINVAL or EFAULT for these zero arguments: EPERM proves the filter is in place).
FILTERED = [
    "unshare user", "unshare mnt", "unshare net", "unshare pid", "unshare user+mnt",
    "ptrace attach", "ptrace seize", "ptrace traceme", "process_vm_readv", "mount tmpfs",
    "setns", "keyctl", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "open_by_handle_at", "kexec_load", "init_module", "fsopen", "pivot_root",
]  # fmt: skip


@pytest.mark.skipif(ARCH not in ("x86_64", "aarch64"), reason="syscall numbers for x86_64/aarch64")
async def test_namespaces_mounts_tracing_and_dangerous_syscalls_are_refused(
    provider: object,
) -> None:
    sb = await new_sandbox(provider)
    result = await sh(sb, "python3 -", stdin=PROBE)
    assert result.exit_code == 0, result
    outcome = json.loads(result.stdout)
    for name in FILTERED:
        assert outcome[name] == "EPERM", (name, outcome)
    # clone(CLONE_NEW*) is not in the filter: no capability (and --disable-userns) refuses it.
    for label in ["user", "mnt", "net", "pid", "user+mnt"]:
        assert outcome[f"clone {label}"] in ("EPERM", "ENOSPC", "EUSERS"), (label, outcome)
    assert outcome["setuid 0"] in ("EPERM", "EINVAL"), outcome  # uid 0 is not even mapped
    await assert_answers(sb)
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_namespace_and_mount_tools_fail(provider: object) -> None:
    sb = await new_sandbox(provider)
    for command in [
        "unshare -U true",
        "unshare -r true",
        "unshare -m true",
        "unshare -n true",
        "unshare -p -f true",
        "mkdir -p /work/m && mount -t tmpfs none /work/m",
        "mount --bind /work /tmp",
        "mount -o remount,rw /",
        "umount /work",
        "strace -f -o /dev/null true",
        # os.unshare exists from Python 3.12; where it is missing this exits 3 (also a "no").
        'python3 -c \'import os, sys; hasattr(os, "unshare") or sys.exit(3); '
        "os.unshare(os.CLONE_NEWUSER)'",
    ]:
        result = await sh(sb, command)
        assert result.exit_code != 0, (command, result)
    # The mounts are unchanged: /work is still the sandbox's size-limited tmpfs.
    mounts = (await sh(sb, "grep -E ' /work | / ' /proc/mounts")).stdout
    assert "/work tmpfs" in mounts and "tmpfs / tmpfs ro," in mounts, mounts
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_no_capabilities_no_root_no_setuid(provider: object) -> None:
    sb = await new_sandbox(provider)
    status = (await sh(sb, "cat /proc/self/status")).stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, (cap, fields[cap])
    assert fields["Uid"].split() == [str(_host.SANDBOX_UID)] * 4
    assert fields["Gid"].split() == [str(_host.SANDBOX_UID)] * 4
    assert fields["NoNewPrivs"].strip() == "1"  # setuid binaries cannot raise privileges
    assert fields["Seccomp"].strip() == "2"  # the filter is installed

    # setuid-root helpers give nothing.
    for command in ["su -c id root", "su root -c 'id -u'", "python3 -c 'import os; os.setuid(0)'"]:
        result = await sh(sb, command, stdin="")
        assert result.exit_code != 0 and "uid=0" not in result.stdout, (command, result)
    assert (await sh(sb, "id -u")).stdout.strip() == str(_host.SANDBOX_UID)
    # Host-wide knobs under /proc/sys are not writable.
    result = await sh(sb, "echo 1 > /proc/sys/vm/drop_caches; echo 1 > /proc/sys/kernel/sysrq")
    assert result.exit_code != 0, result
    await sb.kill()
    assert_no_leftovers({sb.id})


async def test_delegated_cgroup_cannot_raise_its_limits(provider: object) -> None:
    """The sandbox sees its own pids cgroup (/.rollbox/cg) and may create children in it, but
    it cannot raise its limit, and whatever it creates there goes away with the sandbox."""
    sb = await new_sandbox(provider)
    result = await sh(
        sb,
        """
        echo max > /.rollbox/cg/pids.max; echo "raise=$?"
        echo 100000 > /.rollbox/cg/pids.max; echo "raise2=$?"
        echo 1 > /.rollbox/cg/notify_on_release; echo "notify=$?"
        mkdir -p /.rollbox/cg/a/b/c && echo max > /.rollbox/cg/a/b/c/pids.max; echo "nested=$?"
        cat /.rollbox/cg/pids.max
        """,
    )
    assert "raise=0" not in result.stdout and "raise2=0" not in result.stdout, result
    assert "notify=0" not in result.stdout, result
    assert result.stdout.splitlines()[-1] == str(PIDS), result
    assert int(cgroup_file(sb, "pids", "pids.max")) == PIDS  # seen from the host too

    # A child cgroup with pids.max=max is still bounded by its parent.
    bounded = await sh(
        sb,
        "sh -c 'echo $$ > /.rollbox/cg/a/b/c/cgroup.procs; exec python3 -' ",
        stdin=(
            "import os, time\nn = 0\n"
            "while True:\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
            "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n"
            "print(n, flush=True)\nos.killpg(0, 9)\n"
        ),
    )
    assert int(bounded.stdout.split()[0]) < PIDS, bounded
    await sb.kill()
    assert_no_leftovers({sb.id})  # the nested cgroups a/b/c are removed with the sandbox


async def test_the_agent_pid_1_cannot_be_read_or_written_through_proc(provider: object) -> None:
    """The agent holds hidden tests and nonces in memory while it passes them on, and the pipes
    of every command: code running as the same uid must not read /proc/1/mem or write to
    /proc/1/fd/*. The agent is not dumpable, so /proc/1 is root's."""
    sb = await new_sandbox(provider)
    probe = await sh(
        sb,
        "head -c 16 /proc/1/mem >/dev/null 2>&1 && echo mem-readable; "
        "cat /proc/1/environ >/dev/null 2>&1 && echo environ-readable; "
        "for fd in 0 1 2 3 4 5 6 7 8; do "
        "  (echo FORGED > /proc/1/fd/$fd) 2>/dev/null && echo fd-$fd-writable; done; "
        "ls /proc/1/fd >/dev/null 2>&1 && echo fds-listable; echo probed",
    )
    assert probe.stdout == "probed\n", probe.stdout
    await assert_answers(sb, "the probed sandbox")
    await sb.kill()
    assert_no_leftovers({sb.id})
