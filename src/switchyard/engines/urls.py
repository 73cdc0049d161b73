"""Credentials in upstream URLs kept out of what an operator reads.

An upstream may be configured with credentials in its URL (`https://user:secret@host/v1`,
`...?key=...`): the URL is called as written, but where it is shown or recorded (a
deployment's `label` in usage rows, traces, spans and /readyz; every admin answer) its
userinfo and query values are replaced: `https://***@host/v1?key=***`."""

from __future__ import annotations

import functools
import re

# A URL from its `://` to the end of its JSON string (`"`), an escape (a backslash) or
# a space: neither is part of a URL. Each match takes all of its text, so the search
# is linear in the answer whatever the text.
_URL = re.compile(rb'://[^"\\\s]*')


def _query_names(query: bytes) -> bytes:
    """A query with each value replaced: its names stay (`key=***&api-version=***`), a
    part without a name goes whole."""
    if not query:
        return query
    parts = (p.partition(b"=") for p in query.split(b"&"))
    return b"&".join(name + b"=***" if eq else b"***" for name, eq, _ in parts)


def _url_without_credentials(m: re.Match[bytes]) -> bytes:
    """`://user:password@host/path?key=value#f` as `://***@host/path?key=***#f`; a URL
    inside this one (its path) loses its userinfo too, and the query all its values."""
    pieces = []
    for piece in m.group(0).split(b"://")[1:]:
        ends = [i for i in (piece.find(b"/"), piece.find(b"?"), piece.find(b"#")) if i >= 0]
        netloc = piece[: min(ends, default=len(piece))]
        if b"@" in netloc:  # the userinfo runs to the netloc's last `@`
            piece = b"***@" + piece[netloc.rindex(b"@") + 1 :]
        pieces.append(piece)
    url = b"://" + b"://".join(pieces)
    q = url.find(b"?")
    if q < 0:
        return url
    f = url.find(b"#", q)
    stop = len(url) if f < 0 else f
    return url[: q + 1] + _query_names(url[q + 1 : stop]) + url[stop:]


def without_credentials(raw: bytes) -> bytes:
    """JSON text with the userinfo and the query values of every URL in it replaced."""
    if b"://" not in raw:
        return raw
    return _URL.sub(_url_without_credentials, raw)


@functools.lru_cache(maxsize=256)
def shown_url(url: str) -> str:
    """`url` with its userinfo and query values replaced (`without_credentials`), made
    once per URL: a deployment's label is read several times a request."""
    return without_credentials(url.encode()).decode()
