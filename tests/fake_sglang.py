"""A stand-in for an SGLang server on 127.0.0.1 (the GPU node is the edge we cannot reach here).

It answers `/generate` with deterministic `output_ids` derived from the prompt ids and can be told to
fail: HTTP 500, a dropped connection, or a reply slower than the client's timeout.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EOS = 1


def answer_for(input_ids: list[int], length: int = 6) -> list[int]:
    """A reply that is a function of the whole prompt, so two prompts share one as rarely as real replies do."""
    rng = random.Random(hashlib.sha256(json.dumps(input_ids).encode()).digest())
    return [rng.randrange(10, 500) for _ in range(length - 1)] + [EOS]


class FakeSGLang:
    def __init__(self, version: str = "0.5.23", spec_meta: dict | None = None):
        self.version = version
        self.spec_meta = spec_meta or {}  # spec_* keys added to every answer's meta_info
        self.bodies: list[dict] = []  # every /generate request body, in arrival order
        self.faults: list[str] = []  # consumed one per /generate request: "500", "drop", "slow", "ok"
        self.fail_after: int | None = None  # answer this many requests, then 500 forever
        self.slow_s = 2.0
        self.answered: list[tuple[int, ...]] = []  # prompts answered with a 200
        self.requests = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeSGLang:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_fault(self) -> str:
        with self.lock:
            self.requests += 1
            if self.fail_after is not None and len(self.answered) >= self.fail_after:
                return "500"
            return self.faults.pop(0) if self.faults else "ok"

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output quiet
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/server_info":
                    self._send(200, {"version": fake.version, "internal_states": [{}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(request)
                fault = fake._next_fault()
                if fault == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault == "slow":
                    time.sleep(fake.slow_s)
                if fault == "500":
                    self._send(500, {"error": "internal"})
                    return
                if fault == "400":
                    self._send(400, {"error": "bad request: input too long"})
                    return
                ids = request["input_ids"]
                output = answer_for(ids, request["sampling_params"]["max_new_tokens"])
                with fake.lock:
                    fake.answered.append(tuple(ids))
                meta = {"finish_reason": {"type": "stop"}, "prompt_tokens": len(ids), "completion_tokens": len(output),
                        **fake.spec_meta}
                self._send(200, {"text": "", "output_ids": output, "meta_info": meta})

        return Handler
