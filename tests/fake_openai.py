"""A stand-in OpenAI-compatible server for client tests: `POST /v1/completions` streams a few text chunks (every
other path and every GET: 404, as turbospec serve answers), recording each request's prompt."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def fake_completions(texts: tuple[str, ...] = ("a", "b")) -> Iterator[tuple[str, list]]:
    """(the server's root URL, the prompts it received so far) while it runs."""
    prompts: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/completions":
                self.send_response(404)
                self.end_headers()
                return
            prompts.append(body.get("prompt"))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for text in texts:
                self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", prompts
    finally:
        srv.shutdown()
        srv.server_close()
