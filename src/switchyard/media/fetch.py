"""Fetching a client-named image URL without handing the client our network.

One parse of the URL (urllib's `urlsplit`) is used for the check and for the request.
The host is resolved once; every address it resolves to is checked, and the
connection goes to exactly those addresses (a resolver pinned to them), so a second
DNS answer can never be dialed (rebinding). Every redirect hop is parsed, resolved
and checked again, up to `max_redirects`. Loopback, private, link-local (cloud
metadata included), CGNAT, multicast, reserved and unspecified addresses are refused
in all their spellings: IPv4-mapped and -compatible IPv6, NAT64 and 6to4 addresses
are judged by the IPv4 address they carry (Python's `ipaddress` calls several of these
global), and numeric host forms other than a dotted quad (`2130706433`, `0x7f.1`,
`127.1`, `0177.0.0.1`, which `getaddrinfo` accepts) are refused outright. No
credentials, cookies, proxies or client headers go out; the body is capped while it
streams, with total and per-read time limits.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, urljoin, urlsplit, urlunsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from switchyard.config import MediaFetchConfig
from switchyard.errors import (
    MediaFetchRefused,
    MediaTimeout,
    MediaTooLarge,
    MediaUnsupported,
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# (family, address) pairs for a host and port, as getaddrinfo gives them.
Resolve = Callable[[str, int], Awaitable[list[tuple[int, str]]]]


_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_THIS_NET = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")
_V4_COMPATIBLE = ipaddress.ip_network("::/96")
_DOTTED_QUAD = re.compile(
    r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}"
)
# A label of a numeric IPv4 form that inet_aton-style parsers take: decimal, octal, hex.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|\d+", re.I)


def blocked(ip: IPAddress) -> str | None:
    """Why an address may not be fetched from, or None when it is public."""
    if isinstance(ip, ipaddress.IPv6Address):
        carried: ipaddress.IPv4Address | None = ip.ipv4_mapped
        if carried is None and ip in _V4_COMPATIBLE and int(ip) > 1:
            carried = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if carried is None and any(ip in n for n in _NAT64):
            carried = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if carried is None and ip in _SIX_TO_FOUR:
            carried = ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF)
        if carried is not None:
            why = blocked(carried)
            return f"{why} (carried in {ip})" if why else None
        if ip in _TEREDO:
            return "a Teredo tunnel address"
    else:
        if ip in _CGNAT:
            return "a carrier-grade NAT address"
        if ip in _THIS_NET:
            return "a 'this network' address"
    for attr, what in (
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address (cloud metadata lives there)"),
        ("is_private", "a private address"),
        ("is_multicast", "a multicast address"),
        ("is_reserved", "a reserved address"),
        ("is_unspecified", "the unspecified address"),
    ):
        if getattr(ip, attr):
            return what
    if not ip.is_global:
        return "not a public address"
    return None


@dataclass(frozen=True, slots=True)
class Target:
    """One parsed, checked hop: the URL as sent and the addresses it may dial."""

    url: str
    host: str  # IDNA, lower case, no brackets
    port: int
    addresses: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class Fetched:
    body: bytes
    media_type: str  # from the magic bytes
    url: str  # the last hop's
    hops: int


_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def sniff(head: bytes) -> str | None:
    """The image type by its first bytes (never by a header), or None."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


class _Pinned(AbstractResolver):
    """Answers only for the checked host, with the checked addresses."""

    def __init__(self, target: Target, on_dial: Callable[[str, int], None] | None) -> None:
        self._target = target
        self._on_dial = on_dial

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        t = self._target
        if host.lower().strip("[]") != t.host:
            raise OSError(f"not the checked host: {host!r}")
        out: list[ResolveResult] = []
        for fam, addr in t.addresses:
            if self._on_dial is not None:
                self._on_dial(addr, t.port)
            out.append(
                {
                    "hostname": host,
                    "host": addr,
                    "port": t.port,
                    "family": fam,
                    "proto": socket.IPPROTO_TCP,
                    "flags": socket.AI_NUMERICHOST,
                }
            )
        return out

    async def close(self) -> None:
        return None


async def _getaddrinfo(host: str, port: int) -> list[tuple[int, str]]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [(int(family), str(sockaddr[0])) for family, _, _, _, sockaddr in infos]


class MediaFetcher:
    """Fetches image URLs under `MediaFetchConfig`. `resolve` and `on_dial` are the
    seams tests use (a stub resolver; a record of every address dialed); `ssl_context`
    the CA bundle for https (the system's by default)."""

    def __init__(
        self,
        cfg: MediaFetchConfig,
        resolve: Resolve | None = None,
        on_dial: Callable[[str, int], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.cfg = cfg
        self._resolve = resolve or _getaddrinfo
        self._on_dial = on_dial
        self._ssl = ssl_context if ssl_context is not None else ssl.create_default_context()
        self._allowed_nets = [ipaddress.ip_network(n, strict=False) for n in cfg.allow_networks]

    # -- the checks -----------------------------------------------------------------
    def parse(self, url: str) -> tuple[SplitResult, str, int]:
        """The URL's one parse, its IDNA host and its port; refuses what is ambiguous."""
        if not isinstance(url, str) or len(url) > 8192:
            raise MediaFetchRefused("the image URL is too long", param="image_url")
        if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url) or "\\" in url:
            raise MediaFetchRefused(
                "the image URL holds whitespace, control characters or backslashes",
                param="image_url",
            )
        parts = urlsplit(url)
        schemes = ("https", "http") if self.cfg.allow_http else ("https",)
        if parts.scheme not in schemes:
            raise MediaFetchRefused(
                f"only {' and '.join(schemes)} image URLs are fetched", param="image_url"
            )
        if "@" in parts.netloc or parts.username is not None or parts.password is not None:
            raise MediaFetchRefused("image URLs may not carry credentials", param="image_url")
        raw_host = parts.hostname
        if not raw_host:
            raise MediaFetchRefused("the image URL has no host", param="image_url")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise MediaFetchRefused(
                "the image URL's port is not valid", param="image_url"
            ) from None
        host = raw_host.strip("[]").lower()
        if "%" in host:  # percent-encoding or an IPv6 zone: no second reading of the host
            raise MediaFetchRefused("the image URL's host is not valid", param="image_url")
        literal = _ip_literal(host)
        if literal is None:
            labels = host.rstrip(".").split(".")
            if len(labels) <= 4 and all(_NUMERIC_LABEL.fullmatch(x) for x in labels):
                raise MediaFetchRefused(
                    f"the host {host!r} is a numeric address in an ambiguous form",
                    param="image_url",
                )
            try:
                host = host.encode("idna").decode("ascii")
            except UnicodeError:
                raise MediaFetchRefused(
                    "the image URL's host is not valid", param="image_url"
                ) from None
        self._check_domain(host, literal is not None)
        return parts, host, port

    def _check_domain(self, host: str, is_ip: bool) -> None:
        if any(_host_matches(host, p) for p in self.cfg.deny_domains):
            raise MediaFetchRefused(f"the host {host!r} is denied", param="image_url")
        allow = self.cfg.allow_domains
        if allow and (is_ip or not any(_host_matches(host, p) for p in allow)):
            raise MediaFetchRefused(
                f"the host {host!r} is not on the allow list", param="image_url"
            )

    def check_address(self, addr: str) -> None:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
        if any(ip in n for n in self._allowed_nets if n.version == ip.version):
            return
        why = blocked(ip)
        if why is not None:
            raise MediaFetchRefused(f"the image URL's host resolves to {why}", param="image_url")

    async def target(self, url: str) -> Target:
        """Parse, resolve once and check every address of one hop."""
        parts, host, port = self.parse(url)
        try:
            addresses = await self._resolve(host, port)
        except OSError:
            raise MediaFetchRefused(
                f"the host {host!r} does not resolve", param="image_url"
            ) from None
        if not addresses:
            raise MediaFetchRefused(f"the host {host!r} does not resolve", param="image_url")
        for _family, addr in addresses:
            self.check_address(addr)
        # The request goes to the URL as parsed here: the checked host (IDNA), its port,
        # the path and query; never the fragment, never a second parser's reading.
        netloc = f"[{host}]" if ":" in host else host
        sent = urlunsplit((parts.scheme, f"{netloc}:{port}", parts.path or "/", parts.query, ""))
        return Target(sent, host, port, tuple(dict.fromkeys(addresses)))

    # -- the fetch ------------------------------------------------------------------
    async def fetch(self, url: str) -> Fetched:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                return await self._follow(url)
        except TimeoutError:
            raise MediaTimeout(
                f"the image was not fetched within {self.cfg.timeout_s:g} s", param="image_url"
            ) from None

    async def _follow(self, url: str) -> Fetched:
        for hop in range(self.cfg.max_redirects + 1):
            target = await self.target(url)
            status, location, body = await self._get(target)
            if status in (301, 302, 303, 307, 308):
                if location is None:
                    raise MediaFetchRefused("a redirect without a Location", param="image_url")
                url = urljoin(target.url, location)
                continue
            if status != 200:
                raise MediaFetchRefused(f"the image URL answered HTTP {status}", param="image_url")
            assert body is not None
            kind = sniff(body[:16])
            if kind is None:
                raise MediaUnsupported(
                    "the fetched content is not a PNG, JPEG, GIF or WebP image", param="image_url"
                )
            return Fetched(body, kind, target.url, hop)
        raise MediaFetchRefused(f"more than {self.cfg.max_redirects} redirects", param="image_url")

    async def _get(self, target: Target) -> tuple[int, str | None, bytes | None]:
        if _ip_literal(target.host) is not None and self._on_dial is not None:
            # aiohttp dials an address literal as it is, without asking the resolver
            for _family, addr in target.addresses:
                self._on_dial(addr, target.port)
        connector = aiohttp.TCPConnector(
            resolver=_Pinned(target, self._on_dial),
            use_dns_cache=False,
            force_close=True,
            ssl=self._ssl,
        )
        timeout = aiohttp.ClientTimeout(sock_read=self.cfg.read_timeout_s)
        async with aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,  # no proxy or netrc from the environment
            timeout=timeout,
            auto_decompress=False,
        ) as session:
            try:
                async with session.get(
                    target.url,
                    allow_redirects=False,
                    headers={"User-Agent": "switchyard-media/1", "Accept": "image/*"},
                ) as resp:
                    if resp.status != 200:
                        return resp.status, resp.headers.get("Location"), None
                    return 200, None, await self._read_capped(resp)
            except (aiohttp.ClientError, OSError) as exc:
                if isinstance(exc, aiohttp.ServerTimeoutError):
                    raise MediaTimeout("the image URL stopped sending", param="image_url") from None
                raise MediaFetchRefused(
                    f"the image could not be fetched ({type(exc).__name__})", param="image_url"
                ) from None

    async def _read_capped(self, resp: aiohttp.ClientResponse) -> bytes:
        cap = self.cfg.max_bytes
        declared = resp.content_length
        if declared is not None and declared > cap:
            raise MediaTooLarge(f"the image is larger than {cap} bytes", param="image_url")
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(65536):
            size += len(chunk)
            if size > cap:
                raise MediaTooLarge(f"the image is larger than {cap} bytes", param="image_url")
            chunks.append(chunk)
        return b"".join(chunks)


def _ip_literal(host: str) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv4Address) and not _DOTTED_QUAD.fullmatch(host):
        return None  # e.g. leading zeros: judged as ambiguous by the caller
    return ip


def _host_matches(host: str, pattern: str) -> bool:
    p = pattern.lower()
    return host == p or ("*" in p and fnmatch.fnmatchcase(host, p))
