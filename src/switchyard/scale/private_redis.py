"""The private `redis-server` of `serve --workers N` when no `storage.redis_url` is set.

Several worker processes must count limits, budgets, task state and breakers together,
and the embedded default has no Redis of its own; so the supervisor starts one for them
(Debian's `redis-server`) and watches it: `PrivateRedis(home).start()` returns the URL
the workers use as their `storage.redis_url`, `alive()` tells the supervisor whether it
still runs, `restart()` replaces a dead one at the same URL, `stop()` ends it.

It is private in every sense: no TCP port (`port 0`), only a Unix socket at
`<home>/run/redis.sock` (the directory 0700, the socket 0600, so only this user reaches
it), no persistence (`save ""`, `appendonly no`: every counter in it is either seeded
again from the ledger at start or short-lived), `daemonize no` (it stays our child; the
kernel's parent-death signal, set through util-linux's `setpriv`, ends it if the
supervisor dies without stopping it). Its settings go in `<home>/run/redis.conf` (0600),
not on the command line, so a `requirepass` taken from `$SWITCHYARD_REDIS_PASSWORD`
(which every Redis client of the state layer sends when it is set) never shows in `ps`.
Its log, stderr included, is `<home>/run/redis.log`: a start that fails names its last line.

A socket file left by a crashed earlier run is removed when nothing answers on it; one
that something still answers on (another gateway on the same home) is an error, since
two gateways must not take each other's state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from switchyard.config import Settings
from switchyard.config.settings import store_target
from switchyard.engines.llamacpp_process import describe_exit
from switchyard.state.redis import REDIS_PASSWORD_ENV
from switchyard.state.sql_pg import is_postgres

log = logging.getLogger("switchyard.workers")

# sun_path holds 108 bytes with the terminating NUL.
_MAX_SOCKET_PATH = 107


class PrivateRedisError(RuntimeError):
    """The private redis-server is missing, could not start, or its socket is taken."""


def gateway_home(settings: Settings, db: str | None = None) -> Path:
    """The gateway's home: the directory of its SQLite file (`db` is the CLI's --db
    override; with PostgreSQL, that of `storage.sqlite_path`)."""
    target = store_target(settings, db)
    if is_postgres(target):
        target = settings.storage.sqlite_path
    return Path(target).expanduser().resolve().parent


def _conf_value(value: str) -> str:
    """A redis.conf argument, double-quoted so spaces and quotes in paths survive."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class PrivateRedis:
    """One supervised redis-server on a Unix socket under `home` (module docstring)."""

    def __init__(
        self,
        home: str | Path,
        binary: str = "redis-server",
        start_timeout_s: float = 10.0,
        stop_grace_s: float = 5.0,
    ) -> None:
        self.run_dir = Path(home).expanduser().resolve() / "run"
        self.socket_path = self.run_dir / "redis.sock"
        self.conf_path = self.run_dir / "redis.conf"
        self.log_path = self.run_dir / "redis.log"
        self._binary = binary
        self._start_timeout_s = start_timeout_s
        self._stop_grace_s = stop_grace_s
        self._proc: subprocess.Popen[bytes] | None = None
        if len(os.fsencode(self.socket_path)) > _MAX_SOCKET_PATH:
            raise PrivateRedisError(
                f"the private Redis socket path {self.socket_path} is longer than a Unix "
                f"socket allows ({_MAX_SOCKET_PATH} bytes): give storage.sqlite_path a "
                "shorter directory, or set storage.redis_url"
            )

    @property
    def url(self) -> str:
        """The URL the workers use as `storage.redis_url` (redis-py's `unix://` form)."""
        return "unix://" + quote(str(self.socket_path))

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the server process still runs (the supervisor restarts it if not)."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Start the server and wait until it answers PING; return its URL. Already
        running: its URL."""
        if self.alive():
            return self.url
        found = shutil.which(self._binary)
        if found is None:
            raise PrivateRedisError(
                f"{self._binary} is not installed: `serve --workers N` without "
                "storage.redis_url runs a private one (Debian's redis-server package; "
                "`make sysdeps` installs it), or set storage.redis_url"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)  # also when an earlier run made it wider
        self._clear_stale_socket()
        self._write_conf()
        cmd = [found, str(self.conf_path)]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # no orphan server if the supervisor is killed
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        with open(self.log_path, "ab") as logf:
            # Its own session: a terminal's Ctrl-C reaches the supervisor, which stops
            # the workers before their Redis.
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()
        log.info("private redis-server (pid %d) on %s", self._proc.pid, self.socket_path)
        return self.url

    def restart(self) -> str:
        """Replace the server (dead or not) by a fresh, empty one at the same URL."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period; the socket file is removed."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self._stop_grace_s)
            except subprocess.TimeoutExpired:
                log.warning("private redis-server (pid %d) ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def _clear_stale_socket(self) -> None:
        """Remove a socket file nothing answers on (a crashed run's); refuse to take
        one that something still serves."""
        try:
            mode = self.socket_path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise PrivateRedisError(f"{self.socket_path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.socket_path))
        except OSError:  # refused: nothing listens any more
            log.info("removing stale Redis socket %s", self.socket_path)
            self.socket_path.unlink()
            return
        finally:
            probe.close()
        raise PrivateRedisError(
            f"something already serves {self.socket_path}: is another gateway running "
            "with this home (storage.sqlite_path)?"
        )

    def _write_conf(self) -> None:
        lines = [
            "port 0",
            f"unixsocket {_conf_value(str(self.socket_path))}",
            "unixsocketperm 600",
            'save ""',
            "appendonly no",
            "daemonize no",
            f"dir {_conf_value(str(self.run_dir))}",
            f"logfile {_conf_value(str(self.log_path))}",
        ]
        password = os.environ.get(REDIS_PASSWORD_ENV)
        if password:  # the state layer's clients send it whenever it is set
            lines.append(f"requirepass {_conf_value(password)}")
        fd = os.open(self.conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(self.conf_path, 0o600)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        client = redis.Redis(
            unix_socket_path=str(self.socket_path),
            password=os.environ.get(REDIS_PASSWORD_ENV) or None,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
        )
        deadline = time.monotonic() + self._start_timeout_s
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    self._proc = None
                    raise PrivateRedisError(
                        f"the private redis-server {describe_exit(code)} at start; "
                        f"last line of {self.log_path}: {self._last_log_line()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise PrivateRedisError(
                        f"the private redis-server did not answer on {self.socket_path} "
                        f"within {self._start_timeout_s:g} s; last line of {self.log_path}: "
                        f"{self._last_log_line()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _last_log_line(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1].strip() if lines else "(empty)"
