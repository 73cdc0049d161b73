"""Image inputs: fetching image URLs, and processing and caching the images."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from switchyard.config.base import Strict


class MediaFetchConfig(Strict):
    """Fetching image URLs named in requests (media/fetch.py). Off by default: a URL
    fetched on a client's behalf is a network permission."""

    enabled: bool = False
    """Fetch http(s) image URLs named in requests; off = only `data:` URIs are taken."""
    allow_domains: list[str] = []
    """Hosts that may be fetched from (`img.example.com`, `*.example.com`); [] = any public host."""
    deny_domains: list[str] = []
    """Hosts never fetched from, in the same forms as `allow_domains`."""
    allow_http: bool = False
    """Fetch plain http:// URLs too (https only otherwise)."""
    allow_networks: list[str] = []
    """CIDRs fetched from although not public (an internal image host); every other loopback,
    private, link-local, CGNAT, multicast, reserved or metadata address is refused in all its
    spellings."""
    max_bytes: int = Field(10 * 1024 * 1024, ge=1)
    """Largest image fetched, in bytes, capped while it streams."""
    timeout_s: float = Field(10.0, gt=0)
    """Seconds a whole fetch may take, redirects included."""
    read_timeout_s: float = Field(5.0, gt=0)
    """Seconds allowed between two reads of a fetch."""
    max_redirects: int = Field(3, ge=0)
    """Redirects followed per fetch, each checked again; 0 = none."""


class MediaConfig(Strict):
    fetch: MediaFetchConfig = MediaFetchConfig()
    """Fetching image URLs named in requests (off by default)."""
    max_side: int = Field(1024, ge=16)
    """Pixels on an image's longer side after resizing, before it goes upstream."""
    format: Literal["jpeg", "png", "webp"] = "jpeg"
    """Format images are re-encoded to for the upstream (no metadata survives)."""
    quality: int = Field(85, ge=1, le=100)
    """Encoder quality for jpeg and webp."""
    max_pixels: int = Field(40_000_000, ge=1)
    """An image whose header claims more pixels is refused before it is decoded."""
    max_images: int = Field(8, ge=1)
    """Image parts per request; more is 400 `media_too_large` before any fetch."""
    cache_max_bytes: int = Field(64 * 1024 * 1024, ge=0)
    """Bytes of processed images kept, by content hash, settings and tenant (never shared across
    tenants; a URL is never a key); 0 = off."""
    workers: int = Field(2, ge=1)
    """Threads per processing step (decode, resize, encode), and fetches at once."""
    queue: int = Field(16, ge=0)
    """Images waiting per step; one more is answered 429 `media_queue_full`."""
