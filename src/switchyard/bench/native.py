"""Native floors for `switchyard bench overhead`: nginx as an instant upstream and as a
reverse proxy in front of it.

The Python floor (a do-nothing uvicorn + aiohttp proxy) says what any Python hop costs;
it does not say what a proxy hop costs at all. Two nginx processes (from Debian, `make
sysdeps`) give that floor, measured in the same interleaved rounds as the Python targets:

- `nginx-direct`: an instant upstream. `POST /v1/chat/completions` is answered with a
  fixed body: the scripted upstream's own JSON reply, or its SSE reply (usage event
  included) when the request body says `"stream": true`. The bodies are captured from
  the running scripted upstream once at start, so both upstreams answer the same bytes.
- `nginx-proxy`: nginx as a reverse proxy (HTTP/1.1, pooled keep-alive connections,
  no buffering, as one proxies event streams) in front of `nginx-direct`.

Core nginx has no directive that answers from the request body, so the instant upstream
reads the body with the mirror module (`mirror_request_body on`, the mirror an internal
`return 204`: one in-process subrequest per request, no socket), lets the static module
miss (`log_not_found off`) and turns that 404 into the fixed reply of a named location
chosen by a `map` over `$request_body`. That costs nginx a few µs a request more than a
bare `return 200`; it is still far below any Python server.

Each nginx runs in the foreground as one process (`daemon off`, `master_process off`: no
master, so no privilege switch and one process tree per target, like the Python targets),
with its config, pid file, error log and temp paths under its own folder of the bench's
temp dir, and `access_log off`.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from switchyard.bench.harness import (
    CHAT_PATH,
    Child,
    StartError,
    chat_body,
    free_port,
    http,
    smoke,
    spawn,
    wait_ready,
)

NGINX_DIRECT = "nginx-direct"
NGINX_PROXY = "nginx-proxy"
TARGETS = (NGINX_DIRECT, NGINX_PROXY)
DESCRIPTIONS = {
    NGINX_DIRECT: "nginx instant upstream: a fixed JSON or SSE reply (the scripted "
    "upstream's bytes) chosen from the request body, one process",
    NGINX_PROXY: "nginx reverse proxy (HTTP/1.1 keep-alive pool, no buffering) in front "
    "of the nginx instant upstream, one process",
}
# What the instant upstream's map looks for in a request body to answer with events.
STREAM_PATTERN = r'"stream"\s*:\s*true'


@dataclass(frozen=True, slots=True)
class Replies:
    """The fixed replies of the instant upstream: a whole JSON reply and an event stream."""

    json: bytes
    sse: bytes


def capture_replies(upstream_chat_url: str, tokens: int) -> Replies:
    """The scripted upstream's replies to the bench's own bodies (the stream with its
    usage event, which a gateway asks for), to be answered byte for byte by nginx."""
    streamed = json.loads(chat_body(True, tokens))
    streamed["stream_options"] = {"include_usage": True}
    status, whole = http("POST", upstream_chat_url, chat_body(False, tokens))
    sse_status, sse = http("POST", upstream_chat_url, json.dumps(streamed).encode())
    if status != 200 or sse_status != 200 or not sse.endswith(b"data: [DONE]\n\n"):
        raise StartError(
            f"the scripted upstream's replies could not be captured for nginx: "
            f"{status} {whole[:200]!r}, {sse_status} {sse[-200:]!r}"
        )
    return Replies(whole, sse)


def quote(body: bytes) -> str:
    """`body` as one single-quoted nginx string for `return`: backslashes, quotes and
    control characters escaped as nginx's parser reads them back, and every `$` written
    as the `$sy_dollar` variable (nginx has no escape for it in a `return` text)."""
    text = body.decode()
    for raw, escaped in (("\\", "\\\\"), ("'", "\\'"), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        text = text.replace(raw, escaped)
    return "'" + text.replace("$", "${sy_dollar}") + "'"


def _common(folder: Path) -> str:
    """The main and http-level lines both nginx processes share: foreground, one
    process, everything it writes under `folder`."""
    temps = "".join(
        f"  {kind}_temp_path {folder / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        "daemon off;\n"
        "master_process off;\n"
        "worker_processes 1;\n"
        f"pid {folder / 'nginx.pid'};\n"
        f"error_log {folder / 'error.log'} warn;\n"
        "events { worker_connections 1024; }\n"
        "http {\n"
        "  access_log off;\n"
        "  keepalive_requests 10000000;\n"
        "  keepalive_timeout 75s;\n"
        f"{temps}"
    )


def upstream_conf(folder: Path, port: int, replies: Replies) -> str:
    """The instant upstream's nginx.conf (see the module docstring for how it chooses
    between the two replies)."""
    return _common(folder) + (
        '  geo $sy_dollar { default "$"; }\n'
        f"  map $request_body $sy_reply {{ '~{STREAM_PATTERN}' @sse; default @json; }}\n"
        "  server {\n"
        f"    listen 127.0.0.1:{port};\n"
        f"    root {folder / 'empty'};\n"
        "    client_body_buffer_size 1m;\n"
        "    client_max_body_size 1m;\n"
        f"    location = {CHAT_PATH} {{\n"
        "      mirror /sy-read-body;\n"
        "      mirror_request_body on;\n"
        "      log_not_found off;\n"
        "      error_page 404 405 = $sy_reply;\n"
        "    }\n"
        "    location = /sy-read-body { internal; return 204; }\n"
        "    location @json {\n"
        "      default_type application/json;\n"
        f"      return 200 {quote(replies.json)};\n"
        "    }\n"
        "    location @sse {\n"
        "      default_type text/event-stream;\n"
        f"      return 200 {quote(replies.sse)};\n"
        "    }\n"
        "    location = /health { default_type text/plain; return 200 'ok'; }\n"
        "    location / { return 404; }\n"
        "  }\n"
        "}\n"
    )


def proxy_conf(folder: Path, port: int, upstream_port: int) -> str:
    """The reverse proxy's nginx.conf: every path to the instant upstream over pooled
    HTTP/1.1 keep-alive connections, replies relayed unbuffered."""
    return _common(folder) + (
        "  upstream sy_instant {\n"
        f"    server 127.0.0.1:{upstream_port};\n"
        "    keepalive 256;\n"
        "  }\n"
        "  server {\n"
        f"    listen 127.0.0.1:{port};\n"
        "    client_body_buffer_size 1m;\n"
        "    client_max_body_size 1m;\n"
        "    location / {\n"
        "      proxy_pass http://sy_instant;\n"
        "      proxy_http_version 1.1;\n"
        '      proxy_set_header Connection "";\n'
        "      proxy_buffering off;\n"
        "    }\n"
        "  }\n"
        "}\n"
    )


def _start_one(
    nginx: str, name: str, workdir: Path, conf: str, port: int, children: list[Child], t: float
) -> str:
    """Write `conf` into the target's own folder, start nginx on it, wait for /health;
    its base URL."""
    folder = workdir / name
    (folder / "empty").mkdir(parents=True, exist_ok=True)
    path = folder / "nginx.conf"
    path.write_text(conf)
    argv = [nginx, "-p", str(folder), "-c", str(path), "-e", str(folder / "error.log")]
    child = spawn(name, argv, workdir)
    children.append(child)
    base = f"http://127.0.0.1:{port}"
    wait_ready(child, lambda: http("GET", base + "/health")[0] == 200, t)
    return base


def start_native(
    nginx: str,
    workdir: Path,
    replies: Replies,
    tokens: int,
    timeout_s: float,
    children: list[Child],
) -> dict[str, str]:
    """Start the instant upstream, then the proxy in front of it; check both answer
    the bench's requests, streamed and not, and return their chat URLs by target. Started children are appended to
    `children` at once, so the caller stops them whatever happens here."""
    up_port, proxy_port = free_port(), free_port()
    up = _start_one(
        nginx,
        NGINX_DIRECT,
        workdir,
        upstream_conf(workdir / NGINX_DIRECT, up_port, replies),
        up_port,
        children,
        timeout_s,
    )
    proxy = _start_one(
        nginx,
        NGINX_PROXY,
        workdir,
        proxy_conf(workdir / NGINX_PROXY, proxy_port, up_port),
        proxy_port,
        children,
        timeout_s,
    )
    urls = {NGINX_DIRECT: up + CHAT_PATH, NGINX_PROXY: proxy + CHAT_PATH}
    for name, url in urls.items():
        smoke(name, url, tokens)
    return urls


def nginx_version(nginx: str) -> str:
    """`nginx -v`'s version (it prints to stderr), or why there is none."""
    try:
        done = subprocess.run([nginx, "-v"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    found = re.search(r"nginx/(\S+)", done.stderr + done.stdout)
    return found.group(1) if found else "unknown"
