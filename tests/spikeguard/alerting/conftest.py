"""Local servers on 127.0.0.1 for the alert channels: HTTP (webhook) and SMTP (aiosmtpd)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from aiosmtpd.controller import Controller


def free_port() -> int:
    """A port with nothing listening on it (a server that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Webhook:
    """A webhook receiver: fails the first ``failures`` posts with HTTP 500, sleeps ``delay``."""

    def __init__(self, failures: int = 0, delay: float = 0.0) -> None:
        self.failures, self.delay = failures, delay
        self.posts: list[dict] = []
        self.attempts = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                owner.attempts += 1
                time.sleep(owner.delay)  # a slow receiver, not a wait on a condition
                if owner.attempts <= owner.failures:
                    self.send_response(500)
                    self.end_headers()
                    return
                owner.posts.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Mailbox:
    """aiosmtpd's handler: keeps every message; ``delay`` makes DATA slow."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.messages: list = []

    async def handle_DATA(self, server, session, envelope):
        if self.delay:
            await asyncio.sleep(self.delay)  # a slow mail server, not a wait on a condition
        self.messages.append(envelope)
        return "250 Message accepted for delivery"


@pytest.fixture
def webhook():
    servers = []

    def make(**kwargs) -> Webhook:
        servers.append(Webhook(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def smtp():
    controllers = []

    def make(delay: float = 0.0) -> tuple[Mailbox, int]:
        box = Mailbox(delay)
        controller = Controller(box, hostname="127.0.0.1", port=free_port())
        controller.start()
        controllers.append(controller)
        return box, controller.port

    yield make
    for controller in controllers:
        controller.stop()


@pytest.fixture
def down_port():
    """A loopback port nothing listens on."""
    return free_port()
