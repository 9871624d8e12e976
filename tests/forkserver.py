"""Start ``harness`` and Python scripts as fresh processes without paying torch's import each time.

A :class:`ForkServer` is a process that has imported torch and harness's
command-line interface once, then waits on a Unix socket. A client (a script
:meth:`ForkServer.client` writes, put on PATH as ``harness``) sends its argv,
working directory, environment and resource limits, and passes its stdin,
stdout and stderr descriptors along. For each request the server forks a
process that takes those descriptors, limits, directory and environment and
runs the command as its console script would; the client exits with that
process's status (or dies of its signal). Each command is thus its own
process, started from a state no command has touched, as it would be from a
terminal. Signals sent to the client do not reach the command, except that
the command is killed when its client goes away.

A request whose environment differs from the server's in anything but what
a shell sets for itself (:data:`SHELL_OWN`) may change what the imports did
(an environment variable torch reads when imported), so it is not forked
from the imported state: its process ``exec``\\ s the real program instead.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Variables a shell sets for itself: the same command with other values of these is the same command.
SHELL_OWN = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
_HEADER = struct.Struct("!Q")
_READY = "ready"

# The client, as a script that runs without site-packages (``-S``): it only needs the standard library.
_CLIENT = r'''
import json, os, resource, signal, socket, struct, sys
def main(address, kind):
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")}
    request = {"kind": kind, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "limits": limits}
    request = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(address)
    socket.send_fds(conn, [struct.pack("!Q", len(request))], [0, 1, 2])
    conn.sendall(request)
    reply = b""
    while chunk := conn.recv(64):
        reply += chunk
    if not reply:
        sys.stderr.write("forkserver: the server closed the connection without a status\n")
        sys.exit(1)
    how, value = reply.decode().split()
    if how == "signal":
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    sys.exit(int(value))
'''


@dataclass(frozen=True)
class Environment:
    """The server's environment before its imports, and what they set in it (torch sets its caches' paths)."""

    before: Mapping[str, str]
    set_by_imports: Mapping[str, str]


def _own(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in SHELL_OWN}


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (length,) = _HEADER.unpack(data)
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise ConnectionError("the client closed the connection mid-request")
        body += chunk
    return json.loads(body), fds


def _exit_code(code: object) -> int:
    """What the interpreter exits with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run(request: Mapping[str, Any], programs: Mapping[str, str]) -> int:
    """In the forked process: run the request as its program would, and return the exit status."""
    kind, argv = request["kind"], list(request["argv"])
    if kind == "harness":
        from harness.cli.main import main

        sys.argv = [programs["harness"], *argv[1:]]
        sys.path[0] = str(Path(programs["harness"]).parent)
        return _exit_code(main())
    script = argv[1]
    sys.argv = argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    import runpy

    runpy.run_path(script, run_name="__main__")
    return 0


def _command(request: Mapping[str, Any], fds: list[int], programs: Mapping[str, str], started: Environment) -> None:
    """The forked command process: take the client's descriptors, limits, directory and environment; never returns."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for name, limit in request["limits"].items():
        which = getattr(resource, name)
        if resource.getrlimit(which) != tuple(limit):
            resource.setrlimit(which, tuple(limit))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    wanted = dict(request["env"])
    if _own(wanted) != _own(started.before):
        program = programs["harness"] if request["kind"] == "harness" else sys.executable
        os.execve(program, [program, *request["argv"][1:]], wanted)
    os.environ.clear()
    os.environ.update({**wanted, **started.set_by_imports})
    try:
        code = _run(request, programs)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _handle(conn: socket.socket, programs: Mapping[str, str], started: Environment) -> None:
    """The forked handler of one connection: fork the command, wait for it, send its status; never returns."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        request, fds = _receive(conn)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _command(request, fds, programs, started)
        for fd in fds:
            os.close(fd)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            readable, _, _ = select.select([conn], [], [], 0.05)
            if readable and not conn.recv(1, socket.MSG_PEEK):  # the client went away: so does its command
                os.kill(pid, signal.SIGKILL)
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        conn.sendall(how.encode())
    finally:
        os._exit(0)


def serve(address: str, programs: Mapping[str, str]) -> None:
    """Import what every command imports, then fork a handler per connection until stdin closes."""
    before = dict(os.environ)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.export  # noqa: F401

    from harness.cli.main import build_parser

    build_parser()
    started = Environment(before, {k: v for k, v in os.environ.items() if k not in before})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    print(_READY, flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable:
            listener.close()
            os.unlink(address)
            return
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _handle(conn, programs, started)
        conn.close()


class ForkServer:
    """A running server for ``env``; :meth:`client` writes the scripts that run commands in it, :meth:`close` stops it."""

    def __init__(self, directory: Path, env: Mapping[str, str]) -> None:
        self.directory = directory
        self.address = str(directory / "socket")
        self.programs = {"harness": str(Path(sys.executable).with_name("harness"))}
        self._proc = subprocess.Popen(
            [sys.executable, __file__, self.address, json.dumps(self.programs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env), cwd=directory, text=True,
        )  # fmt: skip
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline().strip()
        if ready != _READY:
            self.close()
            raise RuntimeError(f"the fork server did not start (it said {ready!r})")

    def client(self, kind: str, name: str) -> Path:
        """An executable at ``directory/bin/name`` that runs ``kind`` (``harness`` or ``python``) in the server."""
        path = self.directory / "bin" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            f"#!{sys.executable} -SE\n{_CLIENT}\nmain({self.address!r}, {kind!r})\n", encoding="utf-8"
        )
        path.chmod(0o755)
        return path

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))
