"""The bwrap arguments that confine every envport sandbox (:class:`~.sandbox.Sandbox` and
``shell-v1``), beyond its mounts.

* ``--unshare-all``: its own mount, PID, network, IPC, UTS and cgroup namespaces;
* ``--cap-drop ALL``: bwrap run by root otherwise keeps *every* capability in the
  sandbox, ``CAP_SYS_ADMIN`` included, and a process holding that in the host's user
  namespace can mount a fresh ``/proc`` (no masks, ``/proc/sys`` writable: the host's
  ``kernel.core_pattern`` runs code as host root);
* ``--new-session``: no ``TIOCSTI`` into a terminal the controller holds;
* ``--unshare-user --uid 0 --gid 0 --disable-userns`` where this bwrap has it (0.8+): the
  sandbox's uid 0 is still the host's uid 0, but the sandbox cannot make a user namespace
  of its own. One such namespace gives a process every capability inside it, the way
  into most of the kernel's attack surface that containers close (nf_tables and other
  netlink families, filesystem mounts). It also gives the sandbox its own keyrings.
  It costs a start ~0.3 ms here.
"""

from __future__ import annotations

import functools
import subprocess

#: What ``--disable-userns`` needs around it (bwrap refuses it without a user namespace).
NO_NESTED_USERNS = ("--unshare-user", "--uid", "0", "--gid", "0", "--disable-userns")


@functools.cache
def nested_userns_args(bwrap: str) -> tuple[str, ...]:
    """:data:`NO_NESTED_USERNS` if ``bwrap`` can run a command with them here (tried
    once per process), else nothing."""
    argv = [bwrap, "--unshare-all", *NO_NESTED_USERNS, "--die-with-parent",
            "--ro-bind", "/", "/", "true"]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return NO_NESTED_USERNS if done.returncode == 0 else ()


def confinement_args(bwrap: str) -> tuple[str, ...]:
    """The namespace, capability and session arguments of every sandbox's bwrap."""
    return ("--unshare-all", "--cap-drop", "ALL", "--new-session", *nested_userns_args(bwrap))
