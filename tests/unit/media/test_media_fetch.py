"""The SSRF suite of the media fetcher: it contacts only loopback servers the tests
start. Every blocked address form is refused before any connection is attempted,
asserted through the fetcher's dial hook, which records every address it dials."""

from __future__ import annotations

import asyncio
import functools
import inspect
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from switchyard.config import MediaFetchConfig
from switchyard.media.fetch import (
    MediaFetcher,
    MediaFetchRefused,
    MediaTimeout,
    MediaTooLarge,
    MediaUnsupported,
    blocked,
    sniff,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64

BLOCKED = [
    "127.0.0.1", "127.255.255.254", "10.0.0.1", "172.16.0.1", "192.168.1.1",
    "169.254.169.254", "100.64.0.1", "100.100.100.200", "0.0.0.0", "0.1.2.3",
    "224.0.0.1", "240.0.0.1", "255.255.255.255", "198.18.0.1", "192.0.2.1",
    "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
    "::127.0.0.1", "::a9fe:a9fe",
    "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b:1::a00:1",
    "2002:7f00:1::1", "2002:a9fe:a9fe::1", "2002:a00:1::",
    "2001::1", "2001:db8::1",
]  # fmt: skip
PUBLIC = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("addr", BLOCKED)
def test_every_non_public_address_form_is_blocked(addr: str) -> None:
    assert blocked(ipaddress.ip_address(addr)) is not None


@pytest.mark.parametrize("addr", PUBLIC)
def test_public_addresses_pass(addr: str) -> None:
    assert blocked(ipaddress.ip_address(addr)) is None


def test_content_type_is_decided_by_magic_bytes() -> None:
    assert sniff(PNG) == "image/png"
    assert sniff(b"\xff\xd8\xff\xe0rest") == "image/jpeg"
    assert sniff(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image/webp"
    assert sniff(b"<html>") is None


class _Server:
    """A loopback HTTP server answering scripted responses by path."""

    def __init__(self) -> None:
        self.port = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.routes: dict[str, Callable[[asyncio.StreamWriter], Awaitable[None]]] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1]
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        self.requests.append((path, headers))
        route = self.routes.get(path.split("?")[0])
        try:
            if route is None:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            else:
                await route(writer)
            await writer.drain()
        finally:
            writer.close()


def _ok(body: bytes, ctype: str = "image/png", length: bool = True) -> Any:
    async def route(w: asyncio.StreamWriter) -> None:
        cl = f"content-length: {len(body)}\r\n" if length else ""
        w.write(f"HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\n{cl}\r\n".encode() + body)

    return route


def _redirect(location: str) -> Any:
    async def route(w: asyncio.StreamWriter) -> None:
        w.write(f"HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\n\r\n".encode())

    return route


def with_server(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test in its own loop with a fresh loopback server as its first
    argument (pytest sees the other parameters only)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        async def main() -> None:
            s = _Server()
            srv = await asyncio.start_server(s.handle, "127.0.0.1", 0)
            s.port = srv.sockets[0].getsockname()[1]
            async with srv:
                await test(s, *args, **kwargs)

        asyncio.run(main())

    params = list(inspect.signature(test).parameters.values())[1:]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return run


def _fetcher(dialed: list[str], **cfg: Any) -> MediaFetcher:
    base: dict[str, Any] = {
        "enabled": True,
        "allow_http": True,
        "allow_networks": ["127.0.0.1/32"],
        "timeout_s": 5,
        "read_timeout_s": 0.5,
    }
    return MediaFetcher(
        MediaFetchConfig(**{**base, **cfg}), on_dial=lambda addr, port: dialed.append(addr)
    )


@with_server
async def test_an_allowed_loopback_image_is_fetched_without_client_headers(
    server: _Server,
) -> None:
    server.routes["/img.png"] = _ok(PNG)
    dialed: list[str] = []
    got = await _fetcher(dialed).fetch(f"http://127.0.0.1:{server.port}/img.png")
    assert got.body == PNG and got.media_type == "image/png" and got.hops == 0
    assert dialed == ["127.0.0.1"]
    ((_, headers),) = server.requests
    assert "cookie" not in headers and "authorization" not in headers
    assert headers["user-agent"].startswith("switchyard-media")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.2:{port}/img.png",  # loopback, not on the allow list
        "http://[::1]:{port}/img.png",
        "http://[::ffff:127.0.0.2]:{port}/img.png",
        "http://2130706434:{port}/img.png",  # 127.0.0.2 as one number
        "http://0x7f.0.0.2:{port}/img.png",
        "http://127.2:{port}/img.png",
        "http://0177.0.0.2:{port}/img.png",
        "http://127.000.0.2:{port}/img.png",
        "http://user:pw@127.0.0.1:{port}/img.png",  # credentials
        "http://127.0.0.1:{port}\\@evil.example/img.png",  # a parser differential
        "http://127.0.0.1:{port}/img.png\r\nX-Injected: 1",
        " http://127.0.0.1:{port}/img.png",
        "file:///etc/passwd",
        "gopher://127.0.0.1:{port}/",
        "ftp://127.0.0.1:{port}/img.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://100.100.100.200/latest/meta-data/",
        "http://%31%32%37.0.0.1:{port}/img.png",  # percent-encoded host
        "http://[fe80::1%25eth0]:{port}/img.png",  # an IPv6 zone
    ],
)
@with_server
async def test_blocked_targets_are_refused_before_any_dial(server: _Server, url: str) -> None:
    server.routes["/img.png"] = _ok(PNG)
    dialed: list[str] = []
    with pytest.raises(MediaFetchRefused):
        await _fetcher(dialed).fetch(url.format(port=server.port))
    assert dialed == [] and server.requests == []


@with_server
async def test_https_only_unless_http_is_allowed(server: _Server) -> None:
    server.routes["/img.png"] = _ok(PNG)
    dialed: list[str] = []
    with pytest.raises(MediaFetchRefused):
        await _fetcher(dialed, allow_http=False).fetch(f"http://127.0.0.1:{server.port}/img.png")
    assert dialed == []


@with_server
async def test_a_redirect_to_a_blocked_address_is_refused_at_that_hop(server: _Server) -> None:
    server.routes["/img.png"] = _ok(PNG)
    server.routes["/r"] = _redirect(f"http://127.0.0.2:{server.port}/img.png")
    server.routes["/ok"] = _redirect("/img.png")
    dialed: list[str] = []
    fetcher = _fetcher(dialed)
    got = await fetcher.fetch(f"http://127.0.0.1:{server.port}/ok")
    assert got.body == PNG and got.hops == 1
    dialed.clear()
    with pytest.raises(MediaFetchRefused):
        await fetcher.fetch(f"http://127.0.0.1:{server.port}/r")
    assert dialed == ["127.0.0.1"]  # the first hop only


@with_server
async def test_redirects_are_capped(server: _Server) -> None:
    server.routes["/loop"] = _redirect("/loop")
    with pytest.raises(MediaFetchRefused, match="redirects"):
        await _fetcher([], max_redirects=3).fetch(f"http://127.0.0.1:{server.port}/loop")
    assert len(server.requests) == 4


@with_server
async def test_a_rebinding_resolver_is_asked_once_per_hop_and_its_answer_pinned(
    server: _Server,
) -> None:
    """The stub's first answer is allowed, its second (the rebind) is not: the fetch
    dials the first and never asks again; a second hop to the same host asks again
    and is refused."""
    server.routes["/img.png"] = _ok(PNG)
    server.routes["/again"] = _redirect(f"http://images.test:{server.port}/img.png")
    answers = iter([[(2, "127.0.0.1")], [(2, "127.0.0.2")], [(2, "127.0.0.2")]])
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[tuple[int, str]]:
        asked.append(host)
        return next(answers)

    dialed: list[str] = []
    cfg = MediaFetchConfig(enabled=True, allow_http=True, allow_networks=["127.0.0.1/32"])
    fetcher = MediaFetcher(cfg, resolve=resolve, on_dial=lambda a, p: dialed.append(a))
    got = await fetcher.fetch(f"http://images.test:{server.port}/img.png")
    assert got.body == PNG and asked == ["images.test"] and dialed == ["127.0.0.1"]
    with pytest.raises(MediaFetchRefused):
        await fetcher.fetch(f"http://images.test:{server.port}/again")
    assert dialed == ["127.0.0.1"]


@with_server
async def test_domain_allow_and_deny_lists(server: _Server) -> None:
    server.routes["/img.png"] = _ok(PNG)

    async def resolve(host: str, port: int) -> list[tuple[int, str]]:
        return [(2, "127.0.0.1")]

    cfg = MediaFetchConfig(
        enabled=True,
        allow_http=True,
        allow_networks=["127.0.0.1/32"],
        allow_domains=["*.images.test"],
        deny_domains=["bad.images.test"],
    )
    fetcher = MediaFetcher(cfg, resolve=resolve)
    url = f"http://cdn.images.test:{server.port}/img.png"
    assert (await fetcher.fetch(url)).body == PNG
    for host in ("bad.images.test", "images.test.evil", "127.0.0.1"):
        with pytest.raises(MediaFetchRefused):
            await fetcher.fetch(f"http://{host}:{server.port}/img.png")


@pytest.mark.parametrize("declared", [True, False])
@with_server
async def test_an_oversized_body_is_refused_while_it_streams(
    server: _Server, declared: bool
) -> None:
    server.routes["/big"] = _ok(PNG + b"\x00" * 5000, length=declared)
    with pytest.raises(MediaTooLarge):
        await _fetcher([], max_bytes=1024).fetch(f"http://127.0.0.1:{server.port}/big")


@with_server
async def test_a_stalled_body_times_out(server: _Server) -> None:
    async def stall(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: 1000\r\n\r\n")
        w.write(PNG[:8])
        await w.drain()
        await asyncio.sleep(3)

    server.routes["/slow"] = stall
    with pytest.raises(MediaTimeout):
        await _fetcher([], read_timeout_s=0.3).fetch(f"http://127.0.0.1:{server.port}/slow")


@with_server
async def test_a_body_that_is_not_an_image_is_refused_whatever_its_header(
    server: _Server,
) -> None:
    server.routes["/fake.png"] = _ok(b"<html>not an image</html>", ctype="image/png")
    with pytest.raises(MediaUnsupported):
        await _fetcher([]).fetch(f"http://127.0.0.1:{server.port}/fake.png")


def _https_server(cert_for: str) -> tuple[Any, Any]:
    """A trustme CA and a server context whose certificate names `cert_for`."""
    import ssl

    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(cert_for).configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    return server_ctx, client_ctx


@pytest.mark.parametrize(("cert_for", "ok"), [("images.test", True), ("other.test", False)])
def test_https_is_verified_against_the_name_in_the_url(cert_for: str, ok: bool) -> None:
    """The connection goes to the pinned address, and TLS still checks the URL's host
    name (a certificate for another name is refused)."""
    server_ctx, client_ctx = _https_server(cert_for)

    async def main() -> None:
        s = _Server()
        s.routes["/img.png"] = _ok(PNG)
        srv = await asyncio.start_server(s.handle, "127.0.0.1", 0, ssl=server_ctx)
        port = srv.sockets[0].getsockname()[1]

        async def resolve(host: str, p: int) -> list[tuple[int, str]]:
            return [(2, "127.0.0.1")]

        dialed: list[str] = []
        cfg = MediaFetchConfig(enabled=True, allow_networks=["127.0.0.1/32"])
        fetcher = MediaFetcher(
            cfg, resolve=resolve, on_dial=lambda a, _p: dialed.append(a), ssl_context=client_ctx
        )
        async with srv:
            if ok:
                got = await fetcher.fetch(f"https://images.test:{port}/img.png")
                assert got.body == PNG
            else:
                with pytest.raises(MediaFetchRefused):
                    await fetcher.fetch(f"https://images.test:{port}/img.png")
        assert dialed == ["127.0.0.1"]

    asyncio.run(main())
