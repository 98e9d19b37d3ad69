"""``envport.sandbox``: real bubblewrap sandboxes, real mounts, real cgroups.

Each test gets its own runtime directory; a fixture checks after every test that no
mount is left under it and no sandbox cgroup is left in any controller. The isolated
tests are skipped (with the reason) where :func:`probe` says isolation is unavailable;
the unisolated fallback and its refusal are tested everywhere by replacing the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from envport.sandbox import (
    Isolation,
    Sandbox,
    SandboxClosedError,
    SandboxConfig,
    SandboxError,
    SandboxFailure,
    SandboxPathError,
    SandboxPool,
    SandboxUnavailableError,
    probe,
)
from envport.sandbox import sandbox as sandbox_mod
from envport.sandbox.cgroups import own_cgroups
from envport.sandbox.mounts import mounted_under
from envport.sandbox.sandbox import cleanup_stale

ISOLATION = probe()
needs_isolation = pytest.mark.skipif(
    not ISOLATION.isolated, reason=f"no sandbox isolation here: {ISOLATION.explain()}"
)


def _sandbox_cgroups() -> list[Path]:
    """This process's sandbox cgroups (other processes may run sandboxes meanwhile)."""
    found: list[Path] = []
    for directory in own_cgroups().values():
        found += directory.glob(f"envport-{os.getpid()}-*")
    return found


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Path]:
    """A runtime dir for this test; afterwards nothing may be left mounted or grouped."""
    rt = tmp_path / "rt"
    yield rt
    assert mounted_under(tmp_path) == [], "a sandbox left mounts behind"
    assert _sandbox_cgroups() == [], "a sandbox left cgroups behind"
    leftovers = [p.name for p in rt.iterdir()] if rt.exists() else []
    assert leftovers == [], f"a sandbox left files behind: {leftovers}"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A small task repository with a test script."""
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "src" / "value.txt").write_text("1\n")
    (root / "test.sh").write_text('#!/bin/bash\n[ "$(cat src/value.txt)" = 2 ]\n')
    (root / "test.sh").chmod(0o755)
    return root


def gone(pids: list[int]) -> bool:
    """No process with any of these pids is left (not even a zombie)."""
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def cfg(runtime: Path, **fields: object) -> SandboxConfig:
    return SandboxConfig(runtime_dir=runtime, **fields)  # type: ignore[arg-type]


# --- commands --------------------------------------------------------------------------


@needs_isolation
async def test_exec_separates_streams_and_keeps_shell_state(runtime: Path, repo: Path) -> None:
    async with await Sandbox.create(cfg(runtime, workspace=repo)) as sb:
        assert sb.isolated
        result = await sb.exec("echo out; echo err >&2; cd src; export X=7; Y=8; false")
        assert (result.exit_code, result.stdout, result.stderr) == (1, "out\n", "err\n")
        assert not result.timed_out
        assert not result.shell_restarted
        again = await sb.exec('pwd; echo "$X$Y"; cat value.txt; printf no-newline')
        assert again.stdout == "/workspace/src\n78\n1\nno-newline"
        quoted = await sb.exec("echo 'it'\"'\"'s'; cat <<'EOF'\n$HOME\nEOF")
        assert quoted.stdout == "it's\n$HOME\n"
        syntax = await sb.exec("if then fi")
        assert syntax.exit_code == 2
        assert "syntax error" in syntax.stderr
        assert (await sb.exec("echo ok")).stdout == "ok\n"  # still in sync


@needs_isolation
async def test_output_is_capped_and_marked(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime, max_output_bytes=1000)) as sb:
        result = await sb.exec("head -c 50000 /dev/zero | tr '\\0' x; echo; echo tail")
        assert result.truncated
        assert len(result.stdout) == 1000
        assert "49006 more bytes of stdout dropped" in result.stderr
        assert (await sb.exec("echo next")).stdout == "next\n"


@needs_isolation
async def test_timeout_kills_the_command_tree_and_keeps_the_shell(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.exec("cd /tmp; KEEP=1")
        result = await sb.exec("sleep 30 & setsid sleep 30 & sleep 30; sleep 30; echo next", 0.3)
        assert result.timed_out
        assert result.exit_code == 124
        assert "killed after its 0.3 s timeout" in result.stderr
        assert result.stdout == "next\n"
        assert not result.shell_restarted
        after = await sb.exec("pwd; echo $KEEP; ps -e -o comm= | grep -c sleep")
        assert after.stdout == "/tmp\n1\n0\n"  # shell state kept; no sleep survived


@needs_isolation
async def test_hung_shell_and_exiting_shell_are_restarted_and_reported(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.write_file("kept.txt", "still here")
        hung = await sb.exec("cd /tmp; while :; do :; done", timeout_s=0.3)
        assert hung.timed_out
        assert hung.shell_restarted
        assert hung.exit_code == 124
        assert "fresh shell" in hung.stderr
        exited = await sb.exec("exit 7")
        assert exited.exit_code == 7
        assert exited.shell_restarted
        assert "the shell exited (status 7)" in exited.stderr
        after = await sb.exec("pwd; cat kept.txt")
        assert after.stdout == "/workspace\nstill here"
        assert sb.restarts == 2


@needs_isolation
async def test_background_processes_are_killed_unless_kept(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.exec("sleep 30 &")
        assert sb.stats()["pids"] == 2  # bwrap's init and the shell
    async with await Sandbox.create(cfg(runtime, keep_background=True)) as sb:
        await sb.exec("sleep 30 &")
        assert sb.stats()["pids"] == 3
        pids = sb.process_ids()
    assert gone(pids)


# --- faults: limits and isolation ---------------------------------------------------------


@needs_isolation
async def test_killed_background_jobs_leave_no_notice_in_the_next_command(
    runtime: Path,
) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        assert (await sb.exec("sleep 100 & sleep 200 & echo started")).stdout == "started\n"
        after = await sb.exec("echo next")
        assert (after.stdout, after.stderr) == ("next\n", "")


@needs_isolation
async def test_fork_bomb_hits_the_pids_limit(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime, pids=40)) as sb:
        result = await sb.exec("for i in $(seq 60); do sleep 20 & done", timeout_s=2)
        assert "fork: retry" in result.stderr or "Resource temporarily unavailable" in (
            result.stderr
        )
        bomb = await sb.exec("bomb() { bomb | bomb & }; bomb", timeout_s=2)
        assert bomb.exit_code in (0, 124)
        assert (await sb.exec("echo alive")).stdout == "alive\n"
        assert sb.stats()["pids"] == 2


@needs_isolation
async def test_memory_hog_is_oom_killed_and_reported(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime, memory_mb=64)) as sb:
        result = await sb.exec(
            "python3 -c 'b = bytearray(512 * 1024 * 1024); print(len(b))'", timeout_s=20
        )
        assert result.oom_killed
        assert result.exit_code == 137
        assert "out of memory (limit 64 MB)" in result.stderr
        assert (await sb.exec("echo alive")).stdout == "alive\n"


@needs_isolation
async def test_a_cpu_limit_throttles_a_busy_loop(runtime: Path) -> None:
    """cpus=0.2: the group's CFS quota is a fifth of its period, and a loop spinning for a
    second of wall time gets about a fifth of a second of CPU (it would get up to a whole
    second unthrottled)."""
    async with await Sandbox.create(cfg(runtime, cpus=0.2)) as sb:
        group = sb._res.cgroup
        assert group is not None
        cpu_dir = group.dirs["cpu"]
        quota = int((cpu_dir / "cpu.cfs_quota_us").read_text())
        period = int((cpu_dir / "cpu.cfs_period_us").read_text())
        assert quota / period == pytest.approx(0.2)
        spin = (
            "python3 -c 'import os, time\n"
            "t = time.monotonic()\n"
            "while time.monotonic() - t < 1.5: pass\n"
            "c = os.times()\n"
            "print(c.user + c.system)'"
        )
        result = await sb.exec(spin, timeout_s=20)
        assert result.exit_code == 0, result.stderr
        assert float(result.stdout) < 0.75  # ~0.3 s: 0.2 CPU over 1.5 s, plus one period


@needs_isolation
async def test_disk_fill_gets_enospc(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime, disk_mb=4, tmp_mb=2)) as sb:
        result = await sb.exec("dd if=/dev/zero of=big bs=1M count=16")
        assert result.exit_code != 0
        assert "No space left on device" in result.stderr
        tmp = await sb.exec("dd if=/dev/zero of=/tmp/big bs=1M count=16")
        assert "No space left on device" in tmp.stderr
        await sb.exec("rm big")
        with pytest.raises(SandboxError, match="workspace is full"):
            await sb.write_file("big.bin", b"x" * (8 * 1024 * 1024))
        assert (await sb.exec("echo alive > a; cat a")).stdout == "alive\n"


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on the host's loopback, which a sandbox must not reach."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join()
    srv.close()


@needs_isolation
async def test_network_is_unreachable(runtime: Path, host_server: int) -> None:
    probe_cmd = f"(echo > /dev/tcp/127.0.0.1/{host_server}) 2>&1 && echo reached"
    async with await Sandbox.create(cfg(runtime)) as sb:
        local = await sb.exec(probe_cmd)
        assert "reached" not in local.stdout
        assert "refused" in local.stdout
        outside = await sb.exec("(echo > /dev/tcp/1.1.1.1/80) 2>&1 && echo reached")
        assert "reached" not in outside.stdout
        assert "unreachable" in outside.stdout
        assert (await sb.exec("ls /sys/class/net 2>/dev/null; cat /proc/net/dev")).stdout
    async with await Sandbox.create(cfg(runtime, network=True)) as sb:
        assert "reached" in (await sb.exec(probe_cmd)).stdout


@needs_isolation
async def test_writes_outside_the_workspace_never_reach_the_host(
    runtime: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "host-file"
    async with await Sandbox.create(cfg(runtime)) as sb:
        for path in ("/x", "/usr/x", "/etc/x", str(marker)):
            result = await sb.exec(f"echo pwned > {path}")
            assert result.exit_code != 0, path
        assert (await sb.exec("mount -o remount,rw /; umount /workspace")).exit_code != 0
        assert not await asyncio.to_thread(marker.exists)
        assert not await asyncio.to_thread(Path("/usr/x").exists)
        await sb.exec("ln -s /etc/passwd link; ln -s ../../.. up")
        for bad in ("/etc/passwd", "../etc/passwd", "link", "up/etc/hostname", ""):
            with pytest.raises(SandboxPathError):
                await sb.read_file(bad)
        with pytest.raises(SandboxPathError):
            await sb.write_file("/tmp/x", "no")
        await sb.write_file("plain.txt", "a file")
        with pytest.raises(SandboxError, match="a parent is not a directory"):
            await sb.write_file("plain.txt/inside/x.txt", "no")
        with pytest.raises(FileNotFoundError):
            await sb.read_file("missing.txt")


# The host-global knobs a sandbox's root (host uid 0, no capabilities) must not turn.
# Each write puts back the value just read: even where the test fails, the host keeps it.
PROC_WRITES = (
    "for f in vm/swappiness kernel/core_pattern; do v=$(cat /proc/sys/$f) || exit 9; "
    'if printf \'%s\\n\' "$v" > /proc/sys/$f; then echo "$f: written"; fi; done; '
    "[ -w /proc/sysrq-trigger ] && echo 'sysrq: writable'; "
    "for f in kcore keys key-users timer_list sched_debug kallsyms kmsg kpagecount kpageflags "
    "kpagecgroup; do "
    '[ -n "$(head -c 64 /proc/$f 2>/dev/null)" ] && echo "$f: readable"; done; '
    "for d in sys irq bus fs driver; do [ -e /proc/$d ] || continue; "
    "awk -v d=/proc/$d '$5 == d && $6 !~ /^ro(,|$)/ {print d \": writable mount\"}' "
    '/proc/self/mountinfo; grep -q " /proc/$d " /proc/self/mountinfo || '
    'echo "$d: not a mount"; done; '
    "cat /proc/sys/kernel/ostype"
)


# What a sandbox's root must not be able to do with capabilities: none are left
# (bwrap run by root keeps them all unless told), so no mount (a fresh /proc has a
# writable /proc/sys: host root through kernel.core_pattern), and no user namespace of
# its own (every capability inside one). Prints one line per thing that worked.
ESCAPES = (
    "grep -q '^CapEff:[[:space:]]*0*$' /proc/self/status || grep CapEff /proc/self/status; "
    "mkdir -p /tmp/p && mount -t proc proc /tmp/p 2>/dev/null && echo 'mounted /proc'; "
    "unshare -U true 2>/dev/null && echo 'made a user namespace'; "
    'python3 -c \'import ctypes; l = ctypes.CDLL(None); print("unshare(CLONE_NEWUSER)") '
    "if l.unshare(0x10000000) == 0 else None'; echo done"
)


@needs_isolation
async def test_the_sandbox_has_no_capabilities_and_no_user_namespaces(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        result = await sb.exec(ESCAPES)
    assert result.stdout == "done\n", result


@needs_isolation
async def test_proc_sys_is_read_only_and_kernel_files_are_masked(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        result = await sb.exec(PROC_WRITES)
        assert result.stdout == "Linux\n", result
        assert "Read-only file system" in result.stderr
        assert (await sb.exec("cat /proc/sys/vm/swappiness /proc/self/status")).exit_code == 0


# Commands that make the persistent shell report exit status 0 for what follows.
FORGE_PRINTF = (
    "printf() { if [[ $2 == __ENVPORT_* && $# == 3 ]]; then builtin printf '%s%d\\n' "
    '"$2" 0; else builtin printf "$@"; fi; }'
)
FORGE_BUILTIN = (
    "builtin() { if [[ $1 == printf && $3 == __ENVPORT_* && $# == 4 ]]; then "
    'command printf \'%s%d\\n\' "$3" 0; else command "$@"; fi; }'
)


@needs_isolation
async def test_a_fresh_shell_reports_the_true_status_whatever_the_agent_defined(
    runtime: Path, repo: Path
) -> None:
    async with await Sandbox.create(cfg(runtime, workspace=repo)) as sb:
        await sb.exec(FORGE_PRINTF)
        assert (await sb.exec("false")).exit_code == 1  # \\builtin printf ignores it
        await sb.exec(FORGE_BUILTIN + "; cd /tmp; echo junk > /tmp/j")
        assert (await sb.exec("false")).exit_code == 0  # the agent's shell lies now
        graded = await sb.exec("./test.sh; echo $?; pwd; ls /tmp", fresh_shell=True)
        assert graded.stdout == "1\n/workspace\n"
        assert (await sb.exec("./test.sh", fresh_shell=True)).exit_code == 1
        assert (await sb.exec("false")).exit_code == 1  # and the agent's shell is gone
        assert sb.restarts == 0


# --- snapshot, restore, reset, fork -------------------------------------------------------


@needs_isolation
async def test_snapshot_restore_and_reset(runtime: Path, repo: Path) -> None:
    async with await Sandbox.create(cfg(runtime, workspace=repo)) as sb:
        await sb.exec("echo 2 > src/value.txt; rm test.sh; mkdir -p d/e; echo x > d/e/f; cd d")
        assert (await sb.exec("cd /workspace && ./test.sh")).exit_code == 127
        snap = await sb.snapshot()
        await sb.exec("cd /workspace; rm -r d; echo 3 > src/value.txt; touch new; VAR=kept")
        await sb.restore(snap)
        listing = await sb.exec("pwd; cat src/value.txt; ls; echo $VAR")
        assert listing.stdout == "/workspace\n2\nd\nsrc\nkept\n"
        await sb.restore(snap.id)  # twice, by id: the snapshot itself never changed
        assert (await sb.exec("cat d/e/f")).stdout == "x\n"
        await sb.exec("cd d/e; export VAR=changed; echo junk > /tmp/junk")
        await sb.reset()
        fresh = await sb.exec("pwd; cat src/value.txt; echo ${VAR:-unset}; ls /tmp | wc -l")
        assert fresh.stdout == "/workspace\n1\nunset\n0\n"
        assert (await sb.exec("./test.sh")).exit_code == 1  # the task's own state again
        assert (repo / "src" / "value.txt").read_text() == "1\n"  # base untouched
        with pytest.raises(SandboxError, match="unknown snapshot"):
            await sb.restore("nope")


@needs_isolation
async def test_reset_cleans_the_shell_in_place(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime, env={"TASK": "t1"})) as sb:
        pid = sb.process_ids()
        await sb.exec(
            "f() { :; }; alias ll=ls; shopt -s nullglob; set -o noclobber; umask 077; "
            "export TASK=changed NEW=1; trap 'echo bye' EXIT; pushd /tmp"
        )
        await sb.reset()
        state = await sb.exec(
            'echo "$TASK ${NEW:-unset}"; type f ll 2>&1 | wc -l; shopt -q nullglob || echo g;'
            " [[ -o noclobber ]] || echo c; umask; trap -p | wc -l; dirs; pwd"
        )
        assert state.stdout == "t1 unset\n2\ng\nc\n0022\n0\n~\n/workspace\n"  # HOME is the workdir
        assert sb.process_ids() == pid  # the same processes: nothing restarted
        await sb.exec("readonly LOCKED=1")
        await sb.reset()  # cannot unset a read-only variable: the shell is replaced
        assert (await sb.exec("echo ${LOCKED:-gone} $TASK")).stdout == "gone t1\n"


@needs_isolation
async def test_nothing_an_episode_leaves_outside_the_workspace_survives_reset(
    runtime: Path,
) -> None:
    async with await Sandbox.create(cfg(runtime, tmp_mb=16)) as sb:
        dev = await sb.exec(
            "echo y > /dev/stash && echo written; df -k --output=size /dev/shm | tail -1"
        )
        assert "Read-only file system" in dev.stderr  # /dev is read-only; /dev/shm is sized
        assert int(dev.stdout) <= 16 * 1024
        pid = sb.process_ids()
        await sb.exec("echo answer > /dev/shm/notes; enable -n cd")
        await sb.reset()  # in place
        assert sb.process_ids() == pid
        after = await sb.exec("ls -A /dev/shm; cd / && pwd")
        assert after.stdout == "/\n", after
        for leak in ("ipcmk -M 4096", "ipcmk -Q", "exec 7>/workspace/leak", "ulimit -H -t 100",
                     "unset() { :; }; declare -g KEEP=1"):  # fmt: skip
            await sb.exec(leak)
            await sb.reset()  # the shell cannot be cleaned in place: restarted
            state = await sb.exec(
                "ipcs -m -q | grep -c 0x; ulimit -Ht; echo ${KEEP:-gone}; type -t unset"
            )
            assert state.stdout == "0\nunlimited\ngone\nbuiltin\n", (leak, state)
            await sb.shell_state()  # a raw line: bash's transient copy of its input is gone
            assert sandbox_mod._extra_fds(sb._shell_pid or 0, sb._shell_std) == []
        assert sb.restarts == 0  # not counted as a failure


@needs_isolation
async def test_fork_copies_workspace_and_shell_state(runtime: Path, repo: Path) -> None:
    async with await Sandbox.create(cfg(runtime, workspace=repo)) as sb:
        await sb.exec(
            "mkdir -p work && cd work && echo parent > f && export E='a b' && L=$'x\\ny' "
            "&& arr=(1 'two 2') && greet() { echo hi $1; } && shopt -s nullglob"
        )
        before = await sb.snapshot()
        children = await sb.fork(3)
        try:
            for i, child in enumerate(children):
                assert child.isolated
                assert child.id != sb.id
                got = await child.exec(
                    'pwd; cat f; echo "$E|$L|${arr[1]}"; greet k; shopt -q nullglob && echo on'
                )
                assert got.stdout == "/workspace/work\nparent\na b|x\ny|two 2\nhi k\non\n"
                await child.exec(f"echo child{i} > f; rm ../src/value.txt")
            for i, child in enumerate(children):
                assert (await child.exec("cat f")).stdout == f"child{i}\n"
            assert (await sb.exec("cat f; ls ../src")).stdout == "parent\nvalue.txt\n"
            grand = (await children[0].fork(1))[0]
            assert (await grand.exec("cat f; pwd")).stdout == "child0\n/workspace/work\n"
            await grand.restore(before)  # a snapshot taken before the fork
            assert (await grand.exec("cat f; ls ../src")).stdout == "parent\nvalue.txt\n"
            await grand.reset()
            assert (await grand.exec("ls")).stdout == "src\ntest.sh\n"
            await grand.close()
        finally:
            for child in children:
                await child.close()
        assert (await sb.exec("cat f")).stdout == "parent\n"


@needs_isolation
async def test_snapshots_keep_deletions_and_replaced_directories(runtime: Path, repo: Path) -> None:
    async with await Sandbox.create(cfg(runtime, workspace=repo)) as sb:
        # A deleted file (a whiteout), a directory replaced by a new one (opaque), a
        # symlink, a fifo, an executable bit, and an attribute change on a base file.
        await sb.exec(
            "rm test.sh && rm -r src && mkdir src && echo new > src/other && "
            "ln -s src/other link && mkfifo pipe && echo '#!/bin/sh' > run && chmod 700 run"
        )
        snap = await sb.snapshot()
        await sb.reset()
        assert (await sb.exec("ls")).stdout == "src\ntest.sh\n"
        await sb.restore(snap)
        listing = await sb.exec("ls; ls src; cat link; stat -c %a run; [ -p pipe ] && echo fifo")
        assert listing.stdout == "link\npipe\nrun\nsrc\nother\nnew\n700\nfifo\n"
        (child,) = await sb.fork(1)  # a layer over a layer: still the same view
        assert (await child.exec("ls; ls src")).stdout == "link\npipe\nrun\nsrc\nother\n"
        await child.close()


@needs_isolation
async def test_many_snapshots_flatten_and_stay_correct(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        snaps = []
        for i in range(sandbox_mod.MAX_LAYERS + 3):
            await sb.exec(f"echo {i} > f{i}; rm -f f{i - 2}")
            snaps.append(await sb.snapshot())
            await sb.restore(snaps[-1])
        assert (await sb.exec("ls | tr '\\n' ' '")).stdout == "f25 f26 "
        await sb.restore(snaps[3])
        assert (await sb.exec("ls | tr '\\n' ' '")).stdout == "f2 f3 "


def _layers(runtime: Path) -> list[Path]:
    return sorted(p for p in runtime.iterdir() if p.name.startswith("L"))


@needs_isolation
async def test_sparse_files_are_snapshotted_and_forked_sparse(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime, disk_mb=16)) as sb:
        made = await sb.exec("truncate -s 100G huge && printf x | dd of=huge bs=1 seek=5G "
                             "conv=notrunc status=none && du -k huge | cut -f1")  # fmt: skip
        assert made.exit_code == 0, made
        snap = await sb.snapshot()  # was: a dense 100 GB copy into a 64 MB tmpfs, OSError
        await sb.exec("rm huge")
        await sb.restore(snap)
        check = "stat -c %s huge; du -k huge | cut -f1; tail -c +5368709121 huge | head -c 1"
        assert (await sb.exec(check)).stdout == f"{100 * 2**30}\n{made.stdout.strip()}\nx"
        (child,) = await sb.fork(1)
        async with child:
            assert (await child.exec("stat -c %s huge")).stdout == f"{100 * 2**30}\n"


@needs_isolation
async def test_a_snapshot_that_cannot_be_copied_is_a_sandbox_error(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(src: Path, dst: Path) -> None:
        raise OSError(28, "No space left on device")

    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.exec("echo x > f")
        monkeypatch.setattr(sandbox_mod, "copy_tree", full)
        with pytest.raises(SandboxError, match="no room"):
            await sb.snapshot()
        with pytest.raises(SandboxError, match=r"fork failed|no room"):
            await sb.fork(1)
        monkeypatch.undo()
        assert (await sb.exec("cat f")).stdout == "x\n"


@needs_isolation
async def test_flattening_copies_only_the_snapshots_not_the_task(
    runtime: Path, tmp_path: Path
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "data.bin").write_bytes(os.urandom(40 * 2**20))  # over disk_mb * 4
    (big / "gone.txt").write_text("g\n")
    async with await Sandbox.create(cfg(runtime, workspace=big, disk_mb=8)) as sb:
        await sb.exec("rm gone.txt")
        for i in range(sandbox_mod.MAX_LAYERS + 3):
            await sb.exec(f"echo {i} > step.txt")
            await sb.restore(await sb.snapshot())
        state = await sb.exec("cat step.txt; ls; cmp -s data.bin /dev/null; echo $?")
        assert state.stdout == f"{sandbox_mod.MAX_LAYERS + 2}\ndata.bin\nstep.txt\n1\n"
        held = [
            sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in _layers(runtime)
        ]
        assert max(held) < 2**20  # the 40 MB of the task's files were never copied


@needs_isolation
async def test_an_unchanged_workspace_is_not_copied_again(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.exec("head -c 2000000 /dev/urandom > data.bin; echo a > f")
        await asyncio.sleep(0.05)  # past the file system clock's tick
        first = await sb.snapshot()
        again = [await sb.snapshot() for _ in range(5)]
        assert all(s.id == first.id for s in again)
        assert len(_layers(runtime)) == 1
        await sb.exec("echo b > f")  # same size, maybe the same clock tick
        changed = await sb.snapshot()
        assert changed.id != first.id
        await sb.exec("echo c > f")
        await sb.restore(changed)
        assert (await sb.exec("cat f")).stdout == "b\n"
        await sb.restore(first)
        assert (await sb.exec("cat f")).stdout == "a\n"


@needs_isolation
async def test_a_pool_hands_out_started_sandboxes_for_any_task(runtime: Path, repo: Path) -> None:
    async with SandboxPool(cfg(runtime), size=2) as pool:
        sb = await pool.create(workspace=repo)
        try:
            assert sb.pool is pool
            assert (await sb.exec("pwd; cat src/value.txt")).stdout == "/workspace\n1\n"
            await sb.exec("echo 2 > src/value.txt; cd src; export V=1")
            (child,) = await sb.fork(1)
            assert child.pool is pool
            assert (await child.exec("pwd; cat value.txt; echo $V")).stdout == (
                "/workspace/src\n2\n1\n"
            )
            await child.reset()
            assert (await child.exec("cat src/value.txt")).stdout == "1\n"
            await child.close()
            empty = await pool.create()
            assert (await empty.exec("ls | wc -l")).stdout == "0\n"
            await empty.close()
        finally:
            await sb.close()
        with pytest.raises(SandboxError, match="another shape"):
            await pool.take(cfg(runtime, memory_mb=7))
    assert pool.idle == 0
    with pytest.raises(SandboxError, match="closed"):
        await pool.create()


# --- lifecycle and fallback ---------------------------------------------------------------


@needs_isolation
async def test_close_is_idempotent_and_final(runtime: Path) -> None:
    sb = await Sandbox.create(cfg(runtime))
    pids = sb.process_ids()
    await sb.close()
    await sb.close()
    assert gone(pids)
    with pytest.raises(SandboxClosedError):
        await sb.exec("true")
    with pytest.raises(SandboxClosedError):
        await sb.fork()


@needs_isolation
async def test_failed_start_leaves_nothing(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_mod.Sandbox, "_bwrap_argv", lambda self, i, b: ["false"])
    with pytest.raises(SandboxError, match="bwrap could not start"):
        await Sandbox.create(cfg(runtime))


STALE_OWNER = """
import asyncio, os, signal, sys
from pathlib import Path
from envport.sandbox import Sandbox, SandboxConfig

async def main():
    sb = await Sandbox.create(SandboxConfig(runtime_dir=Path(sys.argv[1])))
    await sb.exec("echo x > f")
    await sb.snapshot()
    print(sb.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all

asyncio.run(main())
"""


@needs_isolation
async def test_a_bind_bwrap_cannot_make_fails_with_its_message(
    runtime: Path, tmp_path: Path
) -> None:
    with pytest.raises(SandboxFailure, match=r"bwrap could not start the sandbox: .*zz-nope"):
        await Sandbox.create(cfg(runtime, ro_binds={"/usr/zz-nope": tmp_path}))


@needs_isolation
async def test_close_during_an_exec_ends_it_without_a_new_shell(runtime: Path) -> None:
    sb = await Sandbox.create(cfg(runtime))
    running = asyncio.create_task(sb.exec("sleep 10", timeout_s=20))
    await asyncio.sleep(0.3)
    pids = sb.process_ids()
    await sb.close()
    with pytest.raises(SandboxClosedError):
        await running
    assert sb._res.proc is None  # no shell started after the close
    assert gone(pids)


@needs_isolation
async def test_what_a_killed_controller_left_is_cleaned_up(runtime: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STALE_OWNER, str(runtime), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == -9
    sid = out.decode().strip()
    assert mounted_under(runtime / f"S{sid}")  # left behind, as a SIGKILL leaves it
    removed = await asyncio.to_thread(cleanup_stale, runtime)
    assert f"S{sid}" in removed
    assert f"envport-{sid}" in removed
    assert any(name.startswith("L") for name in removed)  # the snapshot's layer


def test_bad_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="would hide the sandbox's own /usr"):
        SandboxConfig(workdir="/usr/src")
    with pytest.raises(ValueError, match="is not a directory"):
        SandboxConfig(workspace=tmp_path / "missing")
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxConfig(memory_mb=0)


async def test_without_isolation_it_refuses_unless_allowed(
    runtime: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = Isolation(None, ("bubblewrap (`bwrap`) is not installed",))
    monkeypatch.setattr(sandbox_mod, "probe", lambda: missing)
    with pytest.raises(SandboxUnavailableError, match=r"not installed.*allow_unisolated=True"):
        await Sandbox.create(cfg(runtime, workspace=repo))
    async with await Sandbox.create(cfg(runtime, workspace=repo, allow_unisolated=True)) as sb:
        assert not sb.isolated
        result = await sb.exec('echo 2 > src/value.txt; cd src; echo "$ENVPORT_UNISOLATED"')
        assert result.stdout == "1\n"
        snap = await sb.snapshot()
        await sb.exec("rm value.txt")
        await sb.restore(snap)
        assert (await sb.exec("cat value.txt")).stdout == "2\n"
        child = (await sb.fork(1))[0]
        assert (await child.exec("pwd")).stdout.endswith("/ws/src\n")
        await child.close()
        hung = await sb.exec("sleep 30", timeout_s=0.2)
        assert hung.timed_out
        assert not hung.shell_restarted
        await sb.reset()
        assert (await sb.exec("cat src/value.txt")).stdout == "1\n"
    assert (repo / "src" / "value.txt").read_text() == "1\n"


@needs_isolation
async def test_concurrent_execs_are_serialised(runtime: Path) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(20)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]
        assert await asyncio.to_thread(os.path.ismount, sb.host_workdir)


@needs_isolation
async def test_the_shell_starts_with_default_signal_actions(runtime: Path) -> None:
    """A launcher that ignores a signal (SIGHUP under nohup) does not pass that on."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        sb = await Sandbox.create(cfg(runtime))
    finally:
        signal.signal(signal.SIGHUP, before)
    async with sb:
        assert (await sb.exec("trap -p")).stdout == ""
        await sb.exec("readonly LOCKED=1")
        await sb.reset()  # the shell is replaced (exec): still default actions
        assert (await sb.exec("trap -p")).stdout == ""


def test_a_bwrap_without_disable_userns_still_confines_the_rest(tmp_path: Path) -> None:
    from envport.sandbox.confine import NO_NESTED_USERNS, confinement_args

    old = tmp_path / "bwrap"  # a bwrap before 0.8: no --disable-userns
    old.write_text('#!/bin/sh\nfor a; do [ "$a" = --disable-userns ] && exit 1; done\nexit 0\n')
    old.chmod(0o755)
    assert confinement_args(str(old)) == ("--unshare-all", "--cap-drop", "ALL", "--new-session")
    new = tmp_path / "bwrap-new"
    new.write_text("#!/bin/sh\nexit 0\n")
    new.chmod(0o755)
    assert confinement_args(str(new))[-len(NO_NESTED_USERNS) :] == NO_NESTED_USERNS


# --- host-side file access vs. a sandbox that swaps paths under it ----------------------
# The controller reads and writes the workspace as root on the host; the sandbox may
# replace any component by a symlink to a host file between a check and the open.

_SWAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir("/workspace")
open("real", "w").write("decoy")
os.symlink(sys.argv[1], "link")
open("ready", "w").close()
while True:  # 'link' is in turn the decoy file and a symlink to the host's file
    libc.renameat2(-100, b"real", -100, b"link", 2)  # RENAME_EXCHANGE
"""


@pytest.fixture
def host_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "host" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("HOST-SECRET\n")
    return secret


def _swap_after_check(monkeypatch: pytest.MonkeyPatch, name: str, target: Path) -> None:
    """The sandbox's move, made at the worst moment: right after the controller's check
    of ``name``, it becomes a symlink to the host's ``target``."""
    check = Sandbox.host_path

    def host_path(self: Sandbox, path: str) -> Path:
        found = check(self, path)
        if path == name:
            where = self.host_workdir / name
            where.unlink()
            where.symlink_to(target)
        return found

    monkeypatch.setattr(Sandbox, "host_path", host_path)


@needs_isolation
async def test_read_file_never_reads_a_host_file_swapped_in_after_the_check(
    runtime: Path, host_secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.write_file("answer.txt", "decoy")
        _swap_after_check(monkeypatch, "answer.txt", host_secret)
        with pytest.raises(SandboxPathError, match="outside the workspace"):
            await sb.read_file("answer.txt")


@needs_isolation
async def test_write_file_never_writes_a_host_file_swapped_in_after_the_check(
    runtime: Path, host_secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.write_file("notes.txt", "decoy")
        _swap_after_check(monkeypatch, "notes.txt", host_secret)
        with pytest.raises(SandboxPathError, match="outside the workspace"):
            await sb.write_file("notes.txt", "pwned", mode=0o777)
    assert await asyncio.to_thread(host_secret.read_text) == "HOST-SECRET\n"
    assert (await asyncio.to_thread(host_secret.stat)).st_mode & 0o777 != 0o777


@needs_isolation
async def test_list_dir_never_lists_a_host_dir_swapped_in_after_the_check(
    runtime: Path, host_secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await Sandbox.create(cfg(runtime)) as sb:
        await sb.exec("mkdir sub")
        check = Sandbox.host_path

        def host_path(self: Sandbox, path: str) -> Path:
            found = check(self, path)
            if path == "sub" and (self.host_workdir / "sub").is_dir():
                (self.host_workdir / "sub").rmdir()
                (self.host_workdir / "sub").symlink_to(host_secret.parent)
            return found

        monkeypatch.setattr(Sandbox, "host_path", host_path)
        with pytest.raises(SandboxPathError):
            await sb.list_dir("sub")


@needs_isolation
async def test_file_tools_stay_in_the_workspace_against_a_live_swapper(
    runtime: Path, host_secret: Path
) -> None:
    """A real race: a process of the sandbox exchanges a file and a symlink to a host file
    as fast as it can while the controller reads and writes the file (unpatched, one
    read in about seven returned the host file)."""
    if not os.path.exists("/usr/bin/python3"):  # noqa: ASYNC240
        pytest.skip("no /usr/bin/python3 to race with")
    async with await Sandbox.create(cfg(runtime, keep_background=True)) as sb:
        await sb.write_file("swap.py", _SWAPPER)
        started = await sb.exec(
            f"python3 swap.py {host_secret} >/dev/null 2>&1 & "
            "while [ ! -e ready ]; do sleep 0.01; done"
        )
        assert started.exit_code == 0
        seen: set[str] = set()
        for _ in range(300):
            with contextlib.suppress(SandboxError, FileNotFoundError):
                seen.add(await sb.read_file("link"))
            with contextlib.suppress(SandboxError, FileNotFoundError):
                await sb.write_file("link", "pwned")
    assert await asyncio.to_thread(host_secret.read_text) == "HOST-SECRET\n"
    assert "HOST-SECRET\n" not in seen


@needs_isolation
@pytest.mark.parametrize(
    "plant",
    [
        # starts a process whenever a child of the shell ends, between steps too
        "trap '( (sleep 1000 &) )' CHLD; sleep 100 &",
        # starts one while the controller's reset inspects the shell
        "trap '[[ $BASH_COMMAND == declare* ]] && ( (sleep 1000 &) )' DEBUG",
        # the same through an alias of a builtin the inspection runs
        "shopt -s expand_aliases; alias declare='( (sleep 1000 &) ); declare'",
    ],
)
async def test_reset_leaves_no_process_or_trap_of_the_last_episode(
    runtime: Path, plant: str
) -> None:
    """An episode's agent must not reach the next episode of the same sandbox."""
    async with await Sandbox.create(cfg(runtime)) as sb:
        assert (await sb.exec(plant)).exit_code == 0
        await sb.reset()
        # the sandbox's monitor, its init and the shell: nothing of the last episode
        assert len(sb.process_ids()) == 3, sb.process_ids()
        after = await sb.exec("trap -p; alias -p; jobs -p")
        assert after.stdout == ""


# Swaps ./d and ./e (a symlink to a host directory) in a loop, as an agent can in its
# workspace while the host copies it (renameat2 RENAME_EXCHANGE).
SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None)
os.chdir(sys.argv[1])
print("go", flush=True)
while True:
    libc.renameat2(-100, b"d", -100, b"e", 2)
"""


def test_a_tree_swapped_while_it_is_copied_never_yields_a_host_file(tmp_path: Path) -> None:
    """A snapshot (and so a fork) copies the agent's live upper layer as root on the
    host. The copy walked it by path: a directory swapped for a symlink to a host
    directory between its stat and its listing was copied from the host (the forked
    child then read the host's file). Each entry is now opened in its directory's
    descriptor with O_NOFOLLOW."""
    import subprocess

    from envport.sandbox.layers import copy_tree

    host = tmp_path / "host"
    host.mkdir()
    (host / "secret.txt").write_text("HOST-SECRET")
    src = tmp_path / "upper"
    src.mkdir()
    (src / "d").mkdir()
    (src / "d" / "secret.txt").write_text("decoy")
    os.symlink(host, src / "e")
    for i in range(1500):  # entries to copy before d and e come round
        (src / f"f{i}").write_text(str(i))
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(src)], stdout=subprocess.PIPE, text=True
    )
    leaked = []
    try:
        assert swapper.stdout is not None
        assert swapper.stdout.readline() == "go\n"
        for k in range(40):
            dst = tmp_path / f"copy{k}"
            dst.mkdir()
            with contextlib.suppress(OSError):  # the race may make a copy fail: never leak
                copy_tree(src, dst)
            for here, _, files in os.walk(dst):  # symlinks not followed
                for name in files:
                    path = Path(here, name)
                    if not path.is_symlink() and "HOST" in path.read_text():
                        leaked.append(path)
    finally:
        swapper.kill()
        swapper.wait()
        if swapper.stdout is not None:
            swapper.stdout.close()
    assert leaked == []
