"""A stub OpenAI-compatible chat server on 127.0.0.1 that answers from a queue of canned
assistant messages and records the requests (for user-simulator tests)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator


def _handler(replies: list[dict[str, Any]], requests: list[dict[str, Any]], model: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            self._send({"object": "list", "data": [{"id": model, "object": "model"}]})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            self._send({"id": "x", "object": "chat.completion", "created": int(time.time()), "model": body.get("model", model),
                        "choices": [{"index": 0, "message": {"role": "assistant", **replies.pop(0)}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        def _send(self, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextlib.contextmanager
def stub_openai(replies: list[dict[str, Any]], model: str = "customer") -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Yields (base_url, recorded requests); `replies` are assistant messages, e.g. {"content": "hi"}."""
    requests: list[dict[str, Any]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(replies, requests, model))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    finally:
        server.shutdown()
        thread.join()
