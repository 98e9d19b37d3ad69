"""bwrap arguments that make a sandbox's ``/proc`` safe to show to its root.

A sandbox's uid 0 is the host's uid 0 (bwrap, run by root, maps it 0 -> 0), without
capabilities. ``/proc``'s global knobs check only file permissions for most writes, so
a writable ``/proc/sys`` lets such a process change the *host's* sysctls
(``vm.swappiness``) and, through ``kernel.core_pattern``, run code as host root.
bubblewrap's own attempt to cover ``/proc/sys`` is skipped when its ``access(W_OK)``
test on the directory fails (it does here), so the sandboxes do it themselves:

* read-only (bound onto themselves, then the bind made read-only): ``/proc/sys``,
  ``/proc/sysrq-trigger``, ``/proc/fs``, ``/proc/driver``; bwrap itself makes
  ``/proc/irq`` and ``/proc/bus`` read-only (its ``access`` test passes on them);
* masked (``/dev/null`` bound over them), as Docker does, plus a few that leak kernel
  addresses or the host's state: ``kcore``, ``keys``, ``key-users``, ``timer_list``,
  ``timer_stats``, ``sched_debug``, ``latency_stats``, ``kallsyms``, ``kpagecount``,
  ``kpageflags``, ``kpagecgroup``;
* hidden (an empty read-only tmpfs): ``/proc/acpi``, ``/proc/scsi``, ``/proc/asound``.

``/proc/kmsg`` needs no mask: opening it needs ``CAP_SYSLOG`` whatever
``dmesg_restrict`` says, and the sandbox has no capabilities. Each mount costs a start
about a quarter of a millisecond here (bwrap reads ``/proc/self/mountinfo`` after each),
so none is made twice.

Only entries the host's ``/proc`` has are named (bwrap fails on a missing one); they are
global, so the host's list is the sandbox's. The sandbox's ``/proc`` is its own (PID
namespace), the paths under it the same.
"""

from __future__ import annotations

import functools
import os

READ_ONLY = ("sys", "sysrq-trigger", "fs", "driver")
MASKED = (
    "kcore", "keys", "key-users", "timer_list", "timer_stats", "sched_debug",
    "latency_stats", "kallsyms", "kpagecount", "kpageflags", "kpagecgroup",
)  # fmt: skip
HIDDEN = ("acpi", "scsi", "asound")


@functools.cache
def proc_hardening_args(proc: str = "/proc") -> tuple[str, ...]:
    """bwrap arguments to give after ``--proc /proc`` (computed once per process)."""
    args: list[str] = []
    for name in READ_ONLY:
        path = f"{proc}/{name}"
        if os.path.lexists(path):
            args += ["--ro-bind", path, f"/proc/{name}"]
    for name in MASKED:
        if os.path.lexists(f"{proc}/{name}"):
            args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
    for name in HIDDEN:
        if os.path.isdir(f"{proc}/{name}"):
            args += ["--perms", "0555", "--tmpfs", f"/proc/{name}", "--remount-ro",
                     f"/proc/{name}"]  # fmt: skip
    return tuple(args)
