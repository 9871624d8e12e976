"""Drive the system's headless Chromium over the DevTools protocol, from Python only.

The browser is the distribution's package (``/usr/bin/chromium``; the nox test
session installs it with apt), started with a fresh profile and a DevTools
port of its own choosing, which it writes to ``DevToolsActivePort`` in the
profile. The page's WebSocket is driven with ``websocket-client`` (PyPI, in
the ``test`` extra): no browser download, no driver binary.

Every network request outside ``file:``, ``data:``, ``blob:`` and
``about:`` is sent to a proxy on a closed port, so a page that would need
the network fails to load it (a console error) instead of fetching it.

Every wait is bounded: the browser's start, each command's answer and a
page's rendering have :data:`TIMEOUT` seconds, after which the test fails
naming what it waited for.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
TIMEOUT = 60.0
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--proxy-server=127.0.0.1:9",  # the discard port, closed: no request leaves the machine
    "--proxy-bypass-list=<-loopback>",
    "--remote-debugging-port=0",
    "--window-size=1400,1000",
)


@dataclass
class Page:
    """One page of the browser: send commands, and the events that arrived meanwhile."""

    ws: Any
    events: list[dict[str, Any]] = field(default_factory=list)
    _next_id: int = 0

    def send(self, method: str, timeout: float = TIMEOUT, **params: Any) -> dict[str, Any]:
        """Run ``method`` and return its result; events that arrive first are kept in :attr:`events`."""
        self._next_id += 1
        ident = self._next_id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            message = self._receive(left, f"an answer to {method}", timeout)
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            if "method" in message:
                self.events.append(message)

    def wait_for_event(self, method: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            found = next((e for e in self.events if e["method"] == method), None)
            if found is not None:
                return found
            message = self._receive(deadline - time.monotonic(), method, timeout)
            if "method" in message:
                self.events.append(message)

    def _receive(self, left: float, what: str, timeout: float) -> dict[str, Any]:
        """The next message, within ``left`` seconds (else a TimeoutError naming ``what``)."""
        import websocket

        try:
            if left <= 0:
                raise websocket.WebSocketTimeoutException
            self.ws.settimeout(left)
            return dict(json.loads(self.ws.recv()))
        except websocket.WebSocketTimeoutException:
            raise TimeoutError(f"Chromium sent no {what} within {timeout:.0f} s") from None

    def evaluate(self, expression: str, timeout: float = TIMEOUT) -> Any:
        """The value of a JavaScript expression (awaited if it is a promise), as JSON."""
        result = self.send(
            "Runtime.evaluate", timeout, expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and error log entries (failed loads) so far."""
        errors = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                details = p.get("exceptionDetails", {})
                errors.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                entry = p["entry"]
                errors.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())
        return errors

    def requests(self) -> list[str]:
        """Every URL the page asked for."""
        return [e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"]

    def screenshot(self, path: Path, width: int, height: int) -> None:
        """A PNG of the page's top ``width`` x ``height`` CSS pixels."""
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        shot = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})  # fmt: skip
        path.write_bytes(base64.b64decode(shot["data"]))


def _devtools_port(profile: Path, proc: subprocess.Popen[bytes]) -> int:
    """The port Chromium chose, read from the file it writes once it listens."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Chromium exited with code {proc.returncode} before listening")
        try:
            lines = port_file.read_text().split()
        except FileNotFoundError:
            lines = []
        if lines:
            return int(lines[0])
        time.sleep(0.05)
    raise TimeoutError(f"Chromium wrote no {port_file} within {TIMEOUT:.0f} s")


@contextmanager
def open_page(url: str) -> Iterator[Page]:
    """A headless Chromium showing ``url`` (loaded: its load event fired), closed afterwards."""
    import websocket  # websocket-client

    with tempfile.TemporaryDirectory(prefix="harness-chromium-") as profile:
        log = open(os.path.join(profile, "chromium.log"), "wb")  # closed below
        proc = subprocess.Popen(  # a process group of its own: the browser and its helpers, ended together
            [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        ws = None
        try:
            port = _devtools_port(Path(profile), proc)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=TIMEOUT) as answer:
                targets = json.load(answer)
            target = next(t for t in targets if t.get("type") == "page")
            ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=TIMEOUT, suppress_origin=True)
            page = Page(ws)
            for domain in ("Runtime", "Log", "Page", "Network"):
                page.send(f"{domain}.enable")
            page.send("Page.navigate", url=url)
            page.wait_for_event("Page.loadEventFired")
            yield page
        finally:
            if ws is not None:
                with contextlib.suppress(OSError, websocket.WebSocketException):
                    ws.send(json.dumps({"id": 10**6, "method": "Browser.close"}))
                ws.close()
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):  # helpers left behind, or a browser that hung
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
