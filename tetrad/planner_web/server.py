"""The page's HTTP server: the standard library's, on 127.0.0.1 only. GET / is the page,
/page.js and /charts.js its scripts, /api/options its menus; POST /api/plan a plan (api.py). A
user error is an OpenAI-style JSON 400, {"error": {"message", "type"}}, as the serving API's."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import traceback
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from tetrad.errors import ConfigError, TetradError
from tetrad.planner_web.api import PlanPage, Planned, Uploads

HERE = Path(__file__).parent
STATIC = {"/": ("page.html", "text/html; charset=utf-8"),
          "/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/charts.js": ("charts.js", "text/javascript; charset=utf-8")}
MAX_REQUEST_BYTES = 2 << 20  # a request carries at most one config.json upload (api.py)


def _handler(page: PlanPage, lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/api/options":
                self._send_json(200, page.options())
            elif self.path in STATIC:
                name, kind = STATIC[self.path]
                self._send(200, (HERE / name).read_bytes(), kind)
            else:
                self._send_error(404, f"no page at {self.path}", "not_found_error")

        def do_POST(self) -> None:
            if self.path != "/api/plan":
                self._send_error(404, f"no API at {self.path}", "not_found_error")
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_REQUEST_BYTES:
                self._send_error(413, f"a request is at most {MAX_REQUEST_BYTES:,} bytes",
                                 "invalid_request_error")
                return
            try:
                request = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(request, dict):
                    raise ConfigError("the request must be one JSON object")
                with lock:  # one search at a time: they share the planner's caches
                    answer = page.plan(request)
            except json.JSONDecodeError as error:
                self._send_error(400, f"the request is not JSON: {error}",
                                 "invalid_request_error")
            except TetradError as error:
                self._send_error(400, str(error), "invalid_request_error")
            except Exception as error:  # a bug: the page says so, the terminal has the trace
                traceback.print_exc()
                self._send_error(500, f"{type(error).__name__}: {error}", "server_error")
            else:
                self._send_json(200, answer)

        def _send_error(self, status: int, message: str, kind: str) -> None:
            self._send_json(status, {"error": {"message": message, "type": kind}})

        def _send_json(self, status: int, value: dict) -> None:
            self._send(status, json.dumps(value, allow_nan=False).encode(), "application/json")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            pass  # the terminal shows the address and errors, not every request

    return Handler


def serve_page(port: int, open_browser: bool, plan: Callable[[list[str]], Planned],
               choices: dict) -> int:
    """Serve the page until Ctrl-C; `plan` runs `tetrad plan` arguments, `choices` are each
    mode's options with fixed choices (the CLI's own)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0 to 65535, got {port}")
    with tempfile.TemporaryDirectory(prefix="tetrad-plan-web-") as uploads:
        page = PlanPage(plan, choices, Uploads(Path(uploads)))
        try:
            server = ThreadingHTTPServer(("127.0.0.1", port), _handler(page, threading.Lock()))
        except OSError as error:
            raise ConfigError(f"cannot serve on port {port}: {error.strerror}; pick another "
                              f"with --port (0: any free one)") from None
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        print(f"tetrad plan: the page is at {url} (Ctrl-C stops)", flush=True)
        if open_browser:
            webbrowser.open(url)
        with server:
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                print(file=sys.stderr)
    return 0
