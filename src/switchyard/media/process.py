"""Image preprocessing in stages, each with its own bounded queue and workers, off the
event loop: fetch (media/fetch.py) → decode → resize → encode.

A stage whose queue is full refuses at once (429 `media_queue_full`, with
Retry-After): backpressure instead of an unbounded backlog of decoded pixels. Each
stage's wait and service time are returned for the decision trace. Decoding checks
the pixel count from the header before any pixel is decoded (`media.max_pixels`, and
Pillow's own decompression-bomb limit set to it); EXIF orientation is applied and all
metadata (EXIF, GPS, ICC, comments) is dropped by re-encoding only the pixels.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

from PIL import Image, ImageOps

from switchyard.config import MediaConfig
from switchyard.errors import InvalidRequest, MediaQueueFull
from switchyard.media.fetch import (
    MediaFetcher,
    MediaFetchRefused,
    MediaTooLarge,
    MediaUnsupported,
    sniff,
)

T = TypeVar("T")

STAGES = ("fetch", "decode", "resize", "encode")
_FORMATS = {
    "jpeg": ("JPEG", "image/jpeg"),
    "png": ("PNG", "image/png"),
    "webp": ("WEBP", "image/webp"),
}


class Settings(NamedTuple):
    """What an image is made into: the longer side, the format, the quality."""

    max_side: int
    format: str
    quality: int


@dataclass(slots=True)
class Processed:
    data_uri: str
    media_type: str
    bytes_in: int
    bytes_out: int
    size_in: tuple[int, int]
    size_out: tuple[int, int]
    timings_ms: dict[str, tuple[float, float]] = field(default_factory=dict)  # (wait, work)
    cached: bool = False  # answered by the media cache (no decode, resize, encode)


class MediaCache:
    """Processed images by (tenant, content hash, processing settings), LRU within
    `max_bytes`. The tenant is part of the key: one tenant's upload never answers
    another's request, even for the same bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str, tuple[Any, ...]], Processed] = OrderedDict()

    def get(self, key: tuple[str, str, tuple[Any, ...]]) -> Processed | None:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, key: tuple[str, str, tuple[Any, ...]], value: Processed) -> None:
        size = len(value.data_uri)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= len(old.data_uri)
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= len(dropped.data_uri)


class _Stage:
    """A bounded queue in front of `workers` threads."""

    def __init__(self, name: str, workers: int, queue: int) -> None:
        self.name = name
        self._slots = asyncio.Semaphore(workers)
        self._capacity = workers + queue
        self._pending = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"media-{name}")

    def _admit(self) -> None:
        if self._pending >= self._capacity:
            exc = MediaQueueFull(f"the media {self.name} queue is full; retry shortly")
            exc.headers = {"Retry-After": "1"}
            raise exc
        self._pending += 1

    async def run(self, fn: Callable[..., T], *args: Any) -> tuple[T, float, float]:
        """`fn(*args)` on the stage's threads: (result, ms waited, ms worked)."""
        self._admit()
        t0 = time.perf_counter()
        try:
            async with self._slots:
                t1 = time.perf_counter()
                loop = asyncio.get_running_loop()
                out = await loop.run_in_executor(self._pool, fn, *args)
                return out, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000
        finally:
            self._pending -= 1

    async def run_io(self, coro: Awaitable[T]) -> tuple[T, float, float]:
        """An I/O coroutine under the stage's bound (the fetch: no threads needed)."""
        self._admit()
        t0 = time.perf_counter()
        try:
            async with self._slots:
                t1 = time.perf_counter()
                out = await coro
                return out, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def decode_data_uri(uri: str, max_bytes: int) -> bytes:
    head, sep, payload = uri.partition(",")
    if not sep or not head.startswith("data:") or ";base64" not in head:
        raise MediaUnsupported("a data: image URI must be base64-encoded", param="image_url")
    if len(payload) * 3 // 4 > max_bytes:
        raise MediaTooLarge(f"the image is larger than {max_bytes} bytes", param="image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaUnsupported(
            "the data: image URI is not valid base64", param="image_url"
        ) from None


class MediaProcessor:
    """The stages, their queues and workers (media.*)."""

    def __init__(
        self, cfg: MediaConfig, fetcher: MediaFetcher | None = None, workers: int | None = None
    ):
        self.cfg = cfg
        self.fetcher = fetcher if fetcher is not None else MediaFetcher(cfg.fetch)
        n = workers if workers is not None else cfg.workers
        self.stages = {name: _Stage(name, n, queue=cfg.queue) for name in STAGES}
        self.cache = MediaCache(cfg.cache_max_bytes) if cfg.cache_max_bytes else None
        self.defaults = Settings(cfg.max_side, cfg.format, cfg.quality)
        Image.MAX_IMAGE_PIXELS = cfg.max_pixels  # Pillow's bomb check, set explicitly

    async def process(
        self, url: str, tenant: str = "", settings: Settings | None = None
    ) -> Processed:
        """One image part's URL (https, http where allowed, or data:) made into the
        configured format and size, as a data: URI; from the media cache when this
        tenant sent the same bytes before."""
        timings: dict[str, tuple[float, float]] = {}
        t = time.perf_counter()
        if url.startswith("data:"):
            raw = decode_data_uri(url, self.cfg.fetch.max_bytes)
            timings["fetch"] = (0.0, (time.perf_counter() - t) * 1000)
        else:
            if not self.cfg.fetch.enabled:
                raise MediaFetchRefused(
                    "image URLs are not fetched here (media.fetch.enabled is false); "
                    "send the image as a data: URI",
                    param="image_url",
                )
            got, w0, d0 = await self.stages["fetch"].run_io(self.fetcher.fetch(url))
            raw = got.body
            timings["fetch"] = (w0, d0)
        if sniff(raw[:16]) is None:
            raise MediaUnsupported("the image is not a PNG, JPEG, GIF or WebP", param="image_url")
        want = settings or self.defaults
        key = (tenant, hashlib.sha256(raw).hexdigest(), tuple(want))
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return replace(hit, timings_ms={"fetch": timings["fetch"]}, cached=True)
        (img, size_in), w1, d1 = await self.stages["decode"].run(self._decode, raw, want.max_side)
        timings["decode"] = (w1, d1)
        img, w2, d2 = await self.stages["resize"].run(self._resize, img, want.max_side)
        timings["resize"] = (w2, d2)
        (data, media_type), w3, d3 = await self.stages["encode"].run(self._encode, img, want)
        timings["encode"] = (w3, d3)
        uri = f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"
        out = Processed(uri, media_type, len(raw), len(data), size_in, img.size, timings)
        if self.cache is not None:
            self.cache.put(key, out)
        return out

    def _decode(self, raw: bytes, side: int) -> tuple[Image.Image, tuple[int, int]]:
        """The decoded, upright image and the size the file declared (upright too)."""
        try:
            opened = Image.open(io.BytesIO(raw))
            w, h = opened.size  # from the header: nothing decoded yet
            if w * h > self.cfg.max_pixels:
                raise MediaTooLarge(
                    f"the image has {w}x{h} pixels; at most {self.cfg.max_pixels} are decoded",
                    param="image_url",
                )
            if opened.format == "JPEG":
                # Decode at the smallest DCT scale still at least `side` on both sides:
                # a 4K photo for a 1024 target decodes at half size, in a quarter of the
                # time and memory, and is then resized as before.
                opened.draft("RGB", (side, side))
            opened.load()
            img: Image.Image = ImageOps.exif_transpose(opened) or opened
            turned = img.size != opened.size and img.size == opened.size[::-1]
            declared = (h, w) if turned else (w, h)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise MediaTooLarge("the image decodes to too many pixels", param="image_url") from None
        except InvalidRequest:
            raise
        except (OSError, ValueError, SyntaxError):
            raise MediaUnsupported("the image could not be decoded", param="image_url") from None
        return img, declared

    def _resize(self, img: Image.Image, side: int) -> Image.Image:
        if max(img.size) > side:
            img = img.copy()
            img.thumbnail((side, side), Image.Resampling.LANCZOS)
        return img

    def _encode(self, img: Image.Image, want: Settings) -> tuple[bytes, str]:
        fmt, media_type = _FORMATS[want.format]
        mode = "RGB" if fmt == "JPEG" or img.mode not in ("RGB", "RGBA", "L") else img.mode
        # Only the pixels: a fresh image carries no EXIF, GPS, ICC or comment.
        clean = Image.frombytes(mode, img.size, img.convert(mode).tobytes())
        out = io.BytesIO()
        options: dict[str, Any] = {"quality": want.quality} if fmt in ("JPEG", "WEBP") else {}
        clean.save(out, fmt, **options)
        return out.getvalue(), media_type

    def close(self) -> None:
        for stage in self.stages.values():
            stage.close()
