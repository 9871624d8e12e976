"""Run many ``harness`` commands in one long-lived child process, each with its own stdout and stderr.

The bad-input matrix needs what a user sees in a terminal, and needs to
survive a native crash, which an in-process run could not (a SIGFPE in
oneDNN ends pytest itself). Starting a fresh ``harness`` per input would
cost an interpreter and a torch import each time; this worker pays that
once. Each command runs in-process in the worker with file descriptors 1
and 2 pointed at files of their own, so the capture holds everything:
``print``, logging handlers that hold an old ``sys.stderr`` (torch's own
log), and C++ output. If a command kills the worker, :class:`Worker` reports
the signal for that command and starts a new worker for the next.

Protocol: one JSON request per line on the worker's stdin
(``{"argv": [...], "env": {...}, "cwd": "..."}``; ``cwd`` optional, the
directory the command runs in, as a user's terminal would be), one JSON
result per line on a descriptor duplicated from stdout before any command
runs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Outcome:
    """What one command did: its exit code (None: it died of ``signal``), stdout and stderr."""

    code: int | None
    out: str
    err: str
    signal: str | None = None

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err

    @property
    def clean_error(self) -> bool:
        """Exit 2 with one ``error: ...`` line, or argparse's usage and its one error naming the flag."""
        if self.code != 2:
            return False
        if self.err.startswith("usage: harness "):
            last = self.err.rstrip("\n").splitlines()[-1]
            return ": error: argument " in last and "Traceback" not in self.err
        return self.err.startswith("error: ") and self.err.count("\n") == 1


def _run_captured(argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None) -> dict[str, Any]:
    from harness.cli.main import main

    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    saved_cwd = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, fh in zip((1, 2), files, strict=True):
        os.dup2(fh.fileno(), fd)
    try:
        try:
            code: Any = main(list(argv))
        except SystemExit as exc:  # argparse: usage errors exit 2 with their own lines
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - what escaped main() is exactly what is counted
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
        os.chdir(saved_cwd)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    texts = []
    for fh in files:
        fh.seek(0)
        texts.append(fh.read().decode("utf-8", errors="replace"))
        fh.close()
    return {"code": code, "out": texts[0], "err": texts[1]}


def serve(requests: TextIO, replies: TextIO) -> None:
    import harness.cli.main  # noqa: F401 - imported once, before the first request is timed

    for line in requests:
        request = json.loads(line)
        outcome = _run_captured(request["argv"], request.get("env", {}), request.get("cwd"))
        replies.write(json.dumps(outcome) + "\n")
        replies.flush()


class Worker:
    """A worker process, restarted after a command that killed it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        return subprocess.Popen(
            [sys.executable, "-m", "tests.harness_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        cwd: Path | None = None,
    ) -> Outcome:
        """Run one command (in ``cwd``, else the repository); a command still running after
        ``timeout`` seconds is a hang, and is killed."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        request = {"argv": [str(a) for a in argv], "env": dict(env or {}), "cwd": None if cwd is None else str(cwd)}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            proc.kill()
            proc.wait()
            self._proc = None
            return Outcome(None, "", "", signal=f"hang (killed after {timeout:g} s)")
        line = proc.stdout.readline()
        if not line:  # the command killed the worker
            code = proc.wait()
            self._proc = None
            name = signal.Signals(-code).name if code < 0 else f"exit {code}"
            return Outcome(None, "", "", signal=name)
        reply = json.loads(line)
        return Outcome(reply["code"], reply["out"], reply["err"])

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        self._proc = None


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "w")
    serve(sys.stdin, replies)
