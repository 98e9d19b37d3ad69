"""The ``envport`` console script, run as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

import envport
from envport.serving import free_port
from tests.support.cli import pythonpath as support_pythonpath

BIN = Path(sys.executable).parent
ENVPORT = BIN / "envport"

BROKEN_MODULE = '''
from typing import Any, ClassVar

from pydantic import Field

from envport import Action, Env, Observation, StepResult


class PickAction(Action):
    value: int = Field(ge=0)


class GreedyEnv(Env[PickAction, Observation]):
    """Pays more than its reward_range allows."""

    action_type = PickAction
    reward_range = (0.0, 1.0)
    check_actions: ClassVar[list[dict[str, Any]]] = [{"value": 5}]

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[Observation]:
        return StepResult(observation=Observation())

    async def on_step(self, action: PickAction) -> StepResult[Observation]:
        return StepResult(observation=Observation(), reward=float(action.value))
'''


PARROT_MODULE = '''
from envport.envs.echo import EchoEnv


class Parrot(EchoEnv):
    """Echo, under a name whose id rich would read as an emoji code (:parrot:)."""
'''


def envport_cli(
    *args: str, pythonpath: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    if pythonpath is not None:
        env["PYTHONPATH"] = support_pythonpath(pythonpath)
    return subprocess.run(
        [str(ENVPORT), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=50
    )


def test_help_lists_every_command() -> None:
    result = envport_cli("--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve", "check", "init", "envs"):
        assert command in result.stdout


def test_python_dash_m_envport_is_the_same_command() -> None:
    """``python -m envport`` where the console script is not on PATH: same usage line,
    same commands, same exit codes."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    run = [sys.executable, "-m", "envport"]
    result = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "Usage: envport " in result.stdout
    assert " eval" in result.stdout
    assert " gateway" in result.stdout
    wrong = subprocess.run([*run, "no-such-command"], capture_output=True, text=True, env=env)
    assert wrong.returncode == 2
    assert "No such command" in wrong.stderr


def test_root_description_names_what_the_command_does_now() -> None:
    result = envport_cli("--help")
    assert result.returncode == 0, result.stderr
    description = result.stdout.split("Options")[0]  # the text above the tables
    assert "scaffold" not in description
    for command in ("serve", "check", "init", "eval", "run", "gateway", "traces", "train-demo"):
        assert f" {command}" in description, command


def test_serve_help_shows_the_server_options() -> None:
    result = envport_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    for option in (
        "--host",
        "--port",
        "--max-sessions",
        "--max-queue",
        "--queue-timeout",
        "--call-timeout",
        "--idle-timeout",
        "--resume-grace",
        "--max-frame-bytes",
        "--log-level",
    ):
        assert option in result.stdout


SERVER_OPTIONS = {
    "--max-sessions": "max_sessions",
    "--max-queue": "max_queue",
    "--queue-timeout": "queue_timeout_s",
    "--call-timeout": "call_timeout_s",
    "--idle-timeout": "idle_timeout_s",
    "--resume-grace": "resume_grace_s",
    "--max-frame-bytes": "max_frame_bytes",
    "--request-timeout": "request_timeout_s",
    "--mcp-max-sessions": "mcp_max_sessions",
    "--stall-warn": "stall_warn_s",
    "--stall-exit": "stall_exit_s",
}


def _help_defaults(text: str) -> dict[str, str]:
    """Each option's ``[default: ...]`` in rich's help table, its wrapped lines joined."""
    rows: dict[str, str] = {}
    option = None
    for line in text.splitlines():
        if match := re.match(r"│\s+(--[\w-]+)", line):
            option = match.group(1)
            rows[option] = line
        elif option is not None and line.startswith("│"):
            rows[option] += line
    defaults = {}
    for name, row in rows.items():
        flat = " ".join(row.replace("│", " ").split())
        if match := re.search(r"\[default: ([^\]]+)\]", flat):
            defaults[name] = match.group(1)
    return defaults


def test_serve_help_shows_server_config_defaults() -> None:
    """Each server option's help shows ServerConfig's default (it showed none)."""
    from envport.server import ServerConfig

    result = envport_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    shown = _help_defaults(result.stdout)
    for option, field in SERVER_OPTIONS.items():
        assert shown.get(option) == str(ServerConfig.model_fields[field].default), option


def test_version() -> None:
    result = envport_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"envport {envport.__version__}"


def test_envs_lists_echo_with_its_tools() -> None:
    result = envport_cli("envs")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "echo-v1" in line)
    assert "echo, reverse" in row


def test_check_echo_passes() -> None:
    result = envport_cli("check", "echo-v1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "echo-v1: passed" in result.stdout
    assert "reset_determinism" in result.stdout


def test_check_json_output() -> None:
    result = envport_cli("check", "--json", "echo-v1")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["env_id"] == "echo-v1"
    assert {r["name"] for r in report["results"]} >= {"reset", "step_count", "leaks"}


def test_check_a_broken_env_by_import_path_exits_non_zero(tmp_path: Path) -> None:
    (tmp_path / "greedy_env.py").write_text(BROKEN_MODULE)
    result = envport_cli("check", "greedy_env:GreedyEnv", pythonpath=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if "reward_range" in line)
    assert "fail" in row
    assert "5.0" in row
    assert "FAILED" in result.stdout


@pytest.mark.parametrize("command", ["check", "serve"])
def test_unknown_env_suggests_the_closest_id(command: str) -> None:
    result = envport_cli(command, "ecko-v1")
    assert result.returncode == 2
    assert "Unknown environment 'ecko-v1'" in result.stderr
    assert "Did you mean 'echo-v1'?" in result.stderr


def test_an_import_path_that_does_not_import_says_why() -> None:
    result = envport_cli("check", "no_such_module_xyz:Env")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: Cannot load environment 'no_such_module_xyz:Env': could not import module "
        "'no_such_module_xyz' (ModuleNotFoundError: No module named 'no_such_module_xyz')."
    )


def test_an_import_path_without_the_class_names_the_missing_attribute(tmp_path: Path) -> None:
    (tmp_path / "mymodule.py").write_text(PARROT_MODULE)
    result = envport_cli("check", "mymodule:Nope", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: Cannot load environment 'mymodule:Nope': module 'mymodule' has no attribute 'Nope'."
    )


def test_check_a_module_in_the_current_directory(tmp_path: Path) -> None:
    """As the README says: `envport check mymodule:Parrot` from the directory holding
    mymodule.py, with nothing on PYTHONPATH for it."""
    (tmp_path / "mymodule.py").write_text(PARROT_MODULE)
    result = envport_cli("check", "mymodule:Parrot", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mymodule:Parrot: passed" in result.stdout


def test_check_prints_an_import_path_id_as_written(tmp_path: Path) -> None:
    """rich would print "mymodule:Parrot: passed" as "mymodule🦜 passed"."""
    (tmp_path / "mymodule.py").write_text(PARROT_MODULE)
    result = envport_cli("check", "mymodule:Parrot", pythonpath=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    verdict = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"mymodule:Parrot: passed \(\d+ pass(, \d+ (warn|skip))*\)", verdict), (
        verdict
    )
    assert "envport check: mymodule:Parrot" in result.stdout  # the table's title


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ("check", "mymodule:thumbs_up:"),
            "error: Cannot load environment 'mymodule:thumbs_up:': module 'mymodule' has no "
            "attribute 'thumbs_up:'.",
        ),
        (
            ("traces", "list", "--store", "x:smile:.db"),
            "error: No trace store at x:smile:.db; run `envport eval` first or pass --store.",
        ),
    ],
)
def test_user_text_in_errors_prints_as_written(
    tmp_path: Path, args: tuple[str, ...], line: str
) -> None:
    (tmp_path / "mymodule.py").write_text(PARROT_MODULE)
    result = envport_cli(*args, pythonpath=tmp_path, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == line


def test_serve_rejects_bad_option_values_before_starting() -> None:
    result = envport_cli("serve", "echo-v1", "--max-sessions", "0")
    assert result.returncode == 2
    assert "--max-sessions" in result.stderr


def test_serve_refuses_an_origin_no_browser_sends_in_one_line() -> None:
    """``--allow-origin localhost`` was accepted, and could never match."""
    result = envport_cli("serve", "echo-v1", "--allow-origin", "localhost")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: invalid server option: --allow-origin: 'localhost' is not a web origin: use "
        "scheme://host[:port], or scheme://host:* for any port (e.g. https://ui.example, "
        "http://localhost:*)"
    )


def _wait_until_serving(proc: subprocess.Popen[str], base: str) -> None:
    """Return once the server ``proc`` answers ``base``/health (fail if it exits first)."""
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            health = httpx.get(f"{base}/health", timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
    assert health.json() == {"status": "healthy"}


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def test_serve_runs_a_server_that_answers_health_and_resets() -> None:
    port = free_port()
    cmd = [
        str(ENVPORT),
        "serve",
        "echo-v1",
        "--port",
        str(port),
        "--max-sessions",
        "2",
        "--call-timeout",
        "0",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_until_serving(proc, base)
        assert "echo" in json.dumps(httpx.get(f"{base}/metadata", timeout=5).json()).lower()
    finally:
        _stop(proc)
    assert proc.returncode is not None


SERVERS = {
    "envport serve": [str(ENVPORT), "serve"],
    "python -m": [sys.executable, "-m", "envport.server"],
}


@pytest.mark.parametrize("server", SERVERS)
def test_serve_a_module_in_the_current_directory(tmp_path: Path, server: str) -> None:
    """`envport serve mymodule:Parrot` from the directory holding mymodule.py."""
    (tmp_path / "mymodule.py").write_text(PARROT_MODULE)
    port = free_port()
    proc = subprocess.Popen(
        [*SERVERS[server], "mymodule:Parrot", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_until_serving(proc, base)
        assert httpx.get(f"{base}/metadata", timeout=5).json()["name"] == "Parrot"
    finally:
        _stop(proc)


@pytest.mark.parametrize("value", ["bogus", ""])
@pytest.mark.parametrize("server", SERVERS)
def test_serve_rejects_an_unknown_ws_impl_in_one_line(value: str, server: str) -> None:
    """ENVPORT_WS_IMPL bogus or empty: one error line naming the valid values, no server."""
    result = subprocess.run(
        [*SERVERS[server], "echo-v1"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "ENVPORT_WS_IMPL": value},
        timeout=50,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].endswith(
        f"ENVPORT_WS_IMPL={value!r} is not a WebSocket implementation; use one of: "
        "envport, websockets-sansio, websockets-sansio-stock, websockets, wsproto."
    )
    if server == "envport serve":
        assert len(lines) == 1  # (python -m prints argparse's usage above it)


def test_init_generates_a_package_that_passes_check(tmp_path: Path) -> None:
    result = envport_cli("init", "coin-flip", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    root = tmp_path / "coin-flip"
    for relative in (
        "pyproject.toml",
        "README.md",
        "src/coin_flip/__init__.py",
        "src/coin_flip/env.py",
        "tests/test_env.py",
    ):
        assert (root / relative).is_file(), relative

    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["envport.envs"] == {
        "coin_flip": "coin_flip:register"
    }

    checked = envport_cli("check", "coin_flip.env:CoinFlipEnv", pythonpath=root / "src")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "fail" not in checked.stdout.replace("FAILED", "")
    assert "warn" not in checked.stdout

    # The entry point registers NAME-v1.
    registers = subprocess.run(
        [
            sys.executable,
            "-c",
            "import coin_flip, envport; coin_flip.register(); "
            "print(type(envport.make('coin-flip-v1')).__name__)",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": support_pythonpath(root / "src")},
        timeout=50,
    )
    assert registers.stdout.strip() == "CoinFlipEnv", registers.stderr


def test_init_generated_tests_pass(tmp_path: Path) -> None:
    assert envport_cli("init", "coin-flip", "--dir", str(tmp_path)).returncode == 0
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:asyncio",
            "-W",
            "error",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path / "coin-flip",
        timeout=50,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_init_prints_next_steps_that_install_the_test_extra(tmp_path: Path) -> None:
    result = envport_cli("init", "coin-flip", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    steps = result.stdout.split("Next:\n")[1].splitlines()
    assert [line.strip() for line in steps] == [
        f"cd {tmp_path / 'coin-flip'}",
        "pip install -e '.[test]'",  # pytest comes with the [test] extra
        "envport check coin-flip-v1",
        "pytest",
    ]


@pytest.mark.parametrize("name", ["echo", "guess-number"])
def test_init_refuses_a_name_already_registered(tmp_path: Path, name: str) -> None:
    result = envport_cli("init", name, "--dir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {name!r} is already registered ({name}-v1): a new package's "
        f"'{name}-v1' would collide with it. Pick another name."
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("random", "'random', which is a standard-library module"),
        ("json", "'json', which is a standard-library module"),
        ("typing", "'typing', which is a standard-library module"),
        ("pytest", "'pytest', which is already installed ("),
    ],
)
def test_init_refuses_a_package_name_that_import_already_resolves(
    tmp_path: Path, name: str, why: str
) -> None:
    # Before: the scaffold was written, and its own tests imported the other module.
    result = envport_cli("init", name, "--dir", str(tmp_path))
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line
    assert line.startswith(f"error: {name!r} would make the package {why}"), line
    assert line.endswith("Pick another name.")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("command", "creates"),
    [
        (["traces", "list"], False),
        (["traces", "runs"], False),
        (["traces", "show"], False),
        (["traces", "export"], False),
        (["traces", "import"], True),
        (["eval"], True),
        (["run"], True),
        (["gateway"], True),
    ],
)
def test_store_help_says_whether_the_store_is_created(command: list[str], creates: bool) -> None:
    result = envport_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "--store" in line)
    assert ("created if missing" in line) is creates, line
    assert ("must exist" in line) is not creates, line


def test_init_refuses_a_non_empty_directory_and_bad_names(tmp_path: Path) -> None:
    assert envport_cli("init", "coin-flip", "--dir", str(tmp_path)).returncode == 0
    again = envport_cli("init", "coin-flip", "--dir", str(tmp_path))
    assert again.returncode == 2
    assert "already exists" in again.stderr
    bad = envport_cli("init", "Coin Flip", "--dir", str(tmp_path))
    assert bad.returncode == 2
    assert "Invalid environment name" in bad.stderr
