"""The sandbox's seccomp filter: the kernel interfaces sandboxed code has no use for, refused.

A classic BPF program (``struct sock_filter`` array, what ``bwrap --seccomp FD`` loads) built
here without libseccomp. It allows every system call but these, which fail with EPERM:

- new namespaces: ``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag. An
  unprivileged user namespace gives its creator every capability inside it, which opens the
  kernel's mount, netfilter and BPF code to it: the path of most container escapes;
- ``clone3`` fails with ENOSYS instead, because its flags live in memory a filter cannot read;
  glibc and Python then fall back to ``clone``, which the filter can check;
- tracing and reading other processes (``ptrace``, ``process_vm_readv/writev``, ``kcmp``);
- kernel facilities with a history of exploits and no use in a code sandbox: ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, the key ring (``keyctl``, ``add_key``,
  ``request_key``), file handles (``open_by_handle_at``, ``name_to_handle_at``), ``syslog``;
- administration, which needs capabilities the code does not hold anyway: mounts (old and new
  API), ``pivot_root``, ``chroot``, swap, ``reboot``, modules, ``kexec``, ``acct``, ``quotactl``.

A system call of another architecture's table (i386 through ``int 0x80`` on x86-64, or
x32) kills the process: its numbers mean other calls, so the list above would not hold.

The same list as Docker's default profile where the two overlap; Docker also refuses a few
calls that need capabilities the sandbox never holds.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# Linux's syscall numbers for the two architectures jaxrl ships wheels for (asm/unistd_64.h for
# x86-64, asm-generic/unistd.h for aarch64; tests/sandbox checks them against the headers).
_SYSCALLS = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "keyctl": 250, "add_key": 248, "request_key": 249,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "syslog": 103,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "acct": 163, "quotactl": 179,
        "unshare": 272, "setns": 308, "clone": 56, "clone3": 435,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "keyctl": 219, "add_key": 217, "request_key": 218,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "syslog": 116,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "swapon": 224, "swapoff": 225, "reboot": 142, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "acct": 89, "quotactl": 60,
        "unshare": 97, "setns": 268, "clone": 220, "clone3": 435,
    },
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000  # x86-64's x32 ABI: the same numbers with this bit set
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (linux/sched.h)
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
REFUSED = tuple(name for name in _SYSCALLS["x86_64"] if name not in ("clone", "clone3"))

# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64).
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # little-endian: the low word of args[0] comes first
# BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000


def supported_machine() -> str | None:
    """The architecture this filter has a syscall table for (``platform.machine()``), or None."""
    machine = platform.machine()
    return machine if machine in _SYSCALLS else None


def _assemble(program: list[tuple]) -> bytes:
    """Packs ``(opcode, k)``, ``(opcode, k, jump_true_label, jump_false_label)`` and ``("label", name)``
    entries into sock_filter structs, resolving labels to forward offsets (BPF jumps only forward)."""
    labels, position = {}, 0
    for entry in program:
        if entry[0] == "label":
            labels[entry[1]] = position
        else:
            position += 1
    out, position = [], 0
    for entry in program:
        if entry[0] == "label":
            continue
        code, k, *targets = entry
        jumps = [0, 0]
        for i, target in enumerate(targets):
            if target is not None:
                jumps[i] = labels[target] - position - 1
                if not 0 <= jumps[i] <= 255:
                    raise AssertionError(f"seccomp jump to {target!r} out of range")
        out.append(struct.pack("<HBBI", code, jumps[0], jumps[1], k))
        position += 1
    return b"".join(out)


def filter_program(machine: str) -> bytes:
    """The filter of the module docstring for ``machine`` ("x86_64" or "aarch64"), as bytes."""
    numbers = _SYSCALLS[machine]
    program: list[tuple] = [(_LD_W_ABS, _ARCH), (_JEQ_K, _AUDIT_ARCH[machine], None, "kill"), (_LD_W_ABS, _NR)]
    if machine == "x86_64":
        program.append((_JGE_K, _X32_SYSCALL_BIT, "kill", None))
    program += [(_JEQ_K, numbers[name], "refuse", None) for name in REFUSED]
    program += [
        (_JEQ_K, numbers["clone3"], "no_clone3", None),
        (_JEQ_K, numbers["clone"], None, "allow"),
        (_LD_W_ABS, _ARG0_LOW),
        (_JSET_K, CLONE_NAMESPACE_FLAGS, "refuse", "allow"),
        ("label", "allow"), (_RET_K, _RET_ALLOW),
        ("label", "refuse"), (_RET_K, _RET_ERRNO | errno.EPERM),
        ("label", "no_clone3"), (_RET_K, _RET_ERRNO | errno.ENOSYS),
        ("label", "kill"), (_RET_K, _RET_KILL_PROCESS),
    ]
    return _assemble(program)


def filter_fd(machine: str) -> int:
    """A readable file descriptor (a memfd at offset 0) holding ``filter_program(machine)``, for
    ``bwrap --seccomp FD``; the caller passes it to the child and closes it."""
    fd = os.memfd_create("jaxrl-seccomp", os.MFD_CLOEXEC)
    os.write(fd, filter_program(machine))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
