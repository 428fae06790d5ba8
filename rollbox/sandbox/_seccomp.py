"""A seccomp deny-list as classic BPF, for ``bwrap --seccomp FD``.

Hand-assembled rather than built with libseccomp: the program is twenty-odd instructions, needs
no native library on the host, and is easy to audit here. It kills any process that uses a
foreign syscall ABI (x32, i386 via int 0x80) and fails the listed syscalls with EPERM.
"""

from __future__ import annotations

import platform
import struct

# Syscalls sandboxed code never needs: mounts, tracing, kernel keyrings, eBPF, modules, kexec,
# clocks, namespaces, io_uring (which would bypass this filter), raw handles to host files.
_X86_64 = {
    "mount": 165, "umount2": 166, "pivot_root": 155, "swapon": 167, "swapoff": 168,
    "reboot": 169, "sethostname": 170, "setdomainname": 171, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "quotactl": 179, "acct": 163,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "syslog": 103,
    "kexec_load": 246, "kexec_file_load": 320, "keyctl": 250, "add_key": 248,
    "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "open_by_handle_at": 304, "name_to_handle_at": 303, "setns": 308, "unshare": 272,
    "vhangup": 153, "lookup_dcookie": 212, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "fanotify_init": 300, "kcmp": 312,
    # x86_64 only
    "iopl": 172, "ioperm": 173, "uselib": 134, "create_module": 174,
}  # fmt: skip

_AARCH64 = {
    "mount": 40, "umount2": 39, "pivot_root": 41, "swapon": 224, "swapoff": 225,
    "reboot": 142, "sethostname": 161, "setdomainname": 162, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "quotactl": 60, "acct": 89,
    "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "syslog": 116,
    "kexec_load": 104, "kexec_file_load": 294, "keyctl": 219, "add_key": 217,
    "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
    "open_by_handle_at": 265, "name_to_handle_at": 264, "setns": 268, "unshare": 97,
    "vhangup": 58, "lookup_dcookie": 18, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "fanotify_init": 262, "kcmp": 272,
}  # fmt: skip

_ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL, _RET_EPERM = 0x7FFF0000, 0x80000000, 0x00050001
_X32_SYSCALL_BIT = 0x40000000


def supported() -> bool:
    """Whether a filter can be built for this machine's architecture."""
    return platform.machine() in _ARCHES


def denied_syscalls() -> list[str]:
    """The syscalls the filter refuses, for ``rollbox doctor`` and the docs."""
    return sorted(_ARCHES.get(platform.machine(), (0, {}))[1])


def build_filter() -> bytes:
    """The BPF program as bytes of ``struct sock_filter``."""
    arch, table = _ARCHES[platform.machine()]
    numbers = sorted(set(table.values()))
    program: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, _RET_KILL),
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if arch == 0xC000003E:
        program.append((_JGE_K, len(numbers) + 2, 0, _X32_SYSCALL_BIT))  # -> kill below
    for index, number in enumerate(numbers):
        # jump over the remaining comparisons and the allow to the EPERM return
        program.append((_JEQ_K, len(numbers) - index, 0, number))
    program.append((_RET_K, 0, 0, _RET_ALLOW))
    program.append((_RET_K, 0, 0, _RET_EPERM))
    program.append((_RET_K, 0, 0, _RET_KILL))
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
