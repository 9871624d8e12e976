"""The fork server the documentation examples run on: a command through it is the command run fresh."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.forkserver import ForkServer

# Where the forked scripts report what they saw; each prints it as its last line.
REPORT = """
import json, os, resource, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "torch_imported": "torch" in sys.modules,
                  "file_size_limit": list(resource.getrlimit(resource.RLIMIT_FSIZE)),
                  "stdin": sys.stdin.read(), "env": {k: v for k, v in os.environ.items() if k.startswith("FS_")}}))
"""


@dataclass(frozen=True)
class Served:
    env: dict[str, str]
    harness: Path
    python: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("fs")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{directory / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    server = ForkServer(directory, env)
    try:
        yield Served(env, server.client("harness", "harness"), server.client("python", "python-script"))
    finally:
        server.close()


def _run(
    argv: list[str], env: dict[str, str], cwd: Path, stdin: str = "", file_size_limit: int | None = None
) -> subprocess.CompletedProcess[str]:
    def limited() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        argv, env=env, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=300, check=False,
        preexec_fn=None if file_size_limit is None else limited,
    )


def test_a_harness_command_prints_and_exits_as_the_real_one(served: Served, tmp_path: Path) -> None:
    real = str(Path(sys.executable).with_name("harness"))
    for args in (["compile", "--model", "lenet", "--low", "fp16"], ["inspect", "no-such-engine"], ["no-such-command"]):
        forked, fresh = _run([str(served.harness), *args], served.env, tmp_path), _run([real, *args], served.env, tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args


def test_a_script_gets_its_argv_directory_stdin_limits_and_the_imported_state(served: Served, tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    done = _run([str(served.python), str(script), "a b", "c"], served.env, work, stdin="typed\n", file_size_limit=1 << 20)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {
        "argv": [str(script), "a b", "c"],
        "cwd": str(work),
        "torch_imported": True,
        "file_size_limit": [1 << 20, 1 << 20],
        "stdin": "typed\n",
        "env": {},
    }


def test_another_environment_runs_the_real_program_with_it(served: Served, tmp_path: Path) -> None:
    """A variable the imports could have read is not forked from them: the process starts afresh."""
    script = tmp_path / "report.py"
    script.write_text(REPORT, encoding="utf-8")
    done = _run([str(served.python), str(script)], {**served.env, "FS_SETTING": "1"}, tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["env"] == {"FS_SETTING": "1"} and seen["torch_imported"] is False


def test_the_environment_is_what_a_fresh_process_has_after_the_same_imports(served: Served, tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import json, os, torch, torch._dynamo, torch.export\n"
        "print(json.dumps({k: v for k, v in os.environ.items() if k not in ('_', 'PWD', 'OLDPWD', 'SHLVL')}))\n",
        encoding="utf-8",
    )
    forked = _run([str(served.python), str(script)], served.env, tmp_path)
    fresh = _run([sys.executable, str(script)], served.env, tmp_path)
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    assert forked.stdout == fresh.stdout


@pytest.mark.parametrize(
    ("code", "status", "in_stderr"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('bad thing')", 1, "bad thing"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM, ""),
    ],
)
def test_the_exit_status_is_the_scripts(served: Served, tmp_path: Path, code: str, status: int, in_stderr: str) -> None:
    script = tmp_path / "exit.py"
    script.write_text(code + "\n", encoding="utf-8")
    done = _run([str(served.python), str(script)], served.env, tmp_path)
    assert done.returncode == status
    assert in_stderr in done.stderr


def test_a_client_that_goes_away_takes_its_command_along(served: Served, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = tmp_path / "sleep.py"
    script.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    client = subprocess.Popen([str(served.python), str(script)], env=served.env, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the script did not start"
        time.sleep(0.05)
    command = int(pid_file.read_text())
    client.kill()
    client.wait()
    while Path(f"/proc/{command}").exists() and "Z" not in _state(command):
        assert time.monotonic() < deadline, "the command outlived its client"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "Z"
