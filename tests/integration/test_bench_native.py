"""`bench overhead`'s native targets (bench/native.py): nginx as an instant upstream
answering the scripted upstream's bytes, nginx as a reverse proxy in front of it, and a
real run that measures both beside the Python targets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench import native
from switchyard.bench.harness import CHAT_PATH, Child, chat_body, http, stop_all
from switchyard.bench.overhead import _skip_native_without_nginx, target_names
from switchyard.cli import build_parser

needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx (make sysdeps)")


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["bench", "overhead", *argv])


@needs_nginx
def test_the_instant_upstream_answers_by_the_body_and_the_proxy_relays_it(
    tmp_path: Path, scripted: Any
) -> None:
    replies = native.capture_replies(scripted.url + CHAT_PATH, 4)
    assert b'"choices"' in replies.json and b'"usage"' in replies.sse
    children: list[Child] = []
    try:
        urls = native.start_native("nginx", tmp_path, replies, 4, 30.0, children)
        assert tuple(urls) == native.TARGETS
        streamed = json.dumps({"model": "m", "stream" : True}).encode()  # fmt: skip
        for url in urls.values():
            assert http("POST", url, chat_body(False, 4)) == (200, replies.json)
            assert http("POST", url, b'{"model":"m","stream":false}') == (200, replies.json)
            assert http("POST", url, chat_body(True, 4)) == (200, replies.sse)
            assert http("POST", url, streamed) == (200, replies.sse)
            assert http("GET", url.removesuffix(CHAT_PATH) + "/v1/models")[0] == 404
        # Each runs as one process, writing only under its own folder.
        for name in native.TARGETS:
            assert (tmp_path / name / "nginx.pid").read_text().strip() == str(
                next(c.proc.pid for c in children if c.name == name)
            )
    finally:
        stop_all(children)
    assert all(c.proc.returncode is not None for c in children)


@needs_nginx
def test_replies_with_quotes_backslashes_and_dollars_come_back_byte_for_byte(
    tmp_path: Path,
) -> None:
    """nginx reads `$` in a `return` text as a variable and unescapes quoted strings:
    the written config must give back exactly the bytes it was given."""
    tricky = native.Replies(
        b'{"choices":[{"text":"it\'s $HOME, C:\\\\ \\"q\\" \\t; {x}"}]}\n',
        b'data: {"choices":[],"t":"$1 \\\\n"}\r\n\r\ndata: [DONE]\n\n',
    )
    children: list[Child] = []
    try:
        urls = native.start_native("nginx", tmp_path, tricky, 4, 30.0, children)
        assert http("POST", urls[native.NGINX_DIRECT], chat_body(False, 4)) == (200, tricky.json)
        assert http("POST", urls[native.NGINX_PROXY], chat_body(True, 4)) == (200, tricky.sse)
    finally:
        stop_all(children)


def test_without_nginx_the_native_targets_are_skipped_with_a_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _args("--nginx", "/nonexistent/nginx")
    assert native.NGINX_PROXY in target_names(args)
    _skip_native_without_nginx(args)
    assert target_names(args) == ("direct", "floor", "switchyard", "sy-realistic")
    assert "nginx not found ('/nonexistent/nginx')" in capsys.readouterr().err


def test_the_native_upstream_is_refused_where_it_cannot_serve(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, says in (
        (("--native-upstream", "--nginx", "/nonexistent/nginx"), "needs nginx"),
        (("--native-upstream", "--scenario", "governed"), "governed needs the scripted"),
        (("--native-upstream", "--no-native"), "drop --no-native"),
    ):
        args = _args(*argv)
        assert args.func(args) == 2
        assert says in capsys.readouterr().err


@needs_nginx
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk (make sysdeps)")
def test_a_real_run_measures_the_native_targets_beside_the_python_ones(tmp_path: Path) -> None:
    """The smallest real run: one round of one second, core scenario only."""
    out = tmp_path / "result.json"
    args = _args(
        "--scenario", "core", "--duration", "1", "--rounds", "1", "--warmup", "1",
        "--tokens", "4", "--out", str(out),
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert set(native.TARGETS) <= set(result["workload"]["targets"])
    assert result["machine"]["nginx"][0].isdigit()
    for name in native.TARGETS:
        runs = [r for r in result["runs"] if r["target"] == name]
        assert len(runs) == 4  # stream or not, at c=1 and c=32
        for r in runs:
            assert r["requests"] > 0 and r["non_2xx"] == 0 and r["socket_errors"] == 0
            assert r["cpu_us_per_req"] is not None and r["cpu_us_per_req"] > 0
            assert r["upstream_cpu_us_per_req"] is not None
    # The proxy's upstream is the nginx instant upstream, which did work for it.
    assert all(
        r["upstream_cpu_us_per_req"] > 0 for r in result["runs"] if r["target"] == "nginx-proxy"
    )
    for s in result["summary"]:
        assert s["native"]["upstream"] == "nginx-direct"
        assert s["native"]["proxy_cpu_us_per_req"] > 0
        assert s["checks"]["switchyard"]["cpu_ratio"] is not None
