"""Owners named by pid and start time: a reused pid is not taken for the owner."""

from __future__ import annotations

import os
import subprocess
import sys

from envport.procs import owner_alive, owner_tag, parse_owner, start_time


def test_this_process_is_its_own_live_owner() -> None:
    tag = owner_tag()
    pid, start = parse_owner(f"{tag}-abcd1234") or (0, None)
    assert pid == os.getpid()
    assert start == start_time(os.getpid())
    assert start is not None  # procfs here
    assert owner_alive(pid, start)


def test_a_process_with_the_owner_s_pid_but_another_start_time_is_not_the_owner() -> None:
    """What a reused pid looks like: the pid exists, but started at another time."""
    start = start_time(os.getpid())
    assert start is not None
    assert not owner_alive(os.getpid(), start + 1)
    assert owner_alive(os.getpid(), None)  # the older names, a pid alone: as before


def test_an_owner_that_exited_is_dead_even_if_its_pid_comes_back() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from envport.procs import owner_tag; "
            "print(owner_tag(), flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdin is not None
    owner = parse_owner(child.stdout.readline().strip() + "-x")
    assert owner is not None
    assert owner[0] == child.pid
    assert owner_alive(*owner)
    child.stdin.close()
    child.wait()
    child.stdout.close()
    assert not owner_alive(*owner)  # gone; a new process with its pid has another start
    assert start_time(2**22 + 7) is None


def test_names_of_both_forms_parse_and_others_do_not() -> None:
    assert parse_owner("1234-t99887-abcd1234") == (1234, 99887)
    assert parse_owner("1234-abcd1234") == (1234, None)  # written before start times
    assert parse_owner("1234-tabc-ff") == (1234, None)
    assert parse_owner("probe-1234") is None
    assert parse_owner("abc") is None
