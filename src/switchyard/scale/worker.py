"""One worker process of `switchyard serve --workers N` (started by scale/workers.py).

The supervisor writes the worker's spec down its stdin (JSON, then EOF): the config
file, the worker's number, the Redis URL, the control plane's internal URL and token,
and the shared ledger writer's socket. Nothing of it is on the command line or in the
environment of other processes. The worker then:

- builds the gateway with the worker's settings (`worker_settings`: local engines are
  the control plane's engine front, shared state in Redis) and role (config/process.py);
- listens on the gateway's port with its own `SO_REUSEPORT` socket, so the kernel
  spreads new connections over the workers evenly (uvicorn's `--workers` shares one
  listening socket, where whichever process wakes first takes the connection);
- says `ready` on stdout once serving, and stops when the supervisor does (SIGTERM, or
  its parent gone).

    python -m switchyard.scale.worker   (spec on stdin)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

READY_LINE = "switchyard-worker-ready"


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port) that other workers' sockets share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _die_with_parent(parent: int) -> None:
    """Stop (as on SIGTERM) when the supervisor is gone: a worker never outlives it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    import uvicorn

    from switchyard.api.app import create_app
    from switchyard.api.server import uvicorn_options
    from switchyard.config import ProcessRole, load_settings
    from switchyard.scale.serve_config import ENGINE_TOKEN_ENV
    from switchyard.scale.workers import worker_name, worker_settings

    spec: dict[str, Any] = json.loads(sys.stdin.buffer.read())
    _die_with_parent(os.getppid())
    logging.basicConfig(
        level=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s %(name)s [w{spec['index']}]: %(message)s",
    )
    # The control plane's engine front takes this token (the remote engines read it).
    os.environ[ENGINE_TOKEN_ENV] = spec["token"]
    settings = worker_settings(
        load_settings(spec["config"]), spec["control_url"], spec["redis_url"], spec["workers"]
    )
    role = ProcessRole(
        "worker",
        worker_name(int(spec["index"]), os.getpid(), spec.get("run", "")),
        int(spec["index"]),
        spec["control_url"],
        spec["token"],
        spec.get("ledger_socket"),
    )
    app = create_app(settings, role=role)
    sock = reuseport_socket(spec["host"], int(spec["port"]))
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(settings.server)))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            print(READY_LINE, flush=True)

    threading.Thread(target=announce, name="ready", daemon=True).start()
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
