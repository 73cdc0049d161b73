"""Image preprocessing: resized, re-encoded and stripped of metadata, bombs refused
before decoding, full stage queues refusing at once; and end to end through a
vision-capable scripted upstream that records what it receives."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from support.gateways import Gateway, start_gateway
from support.procs import Proc, free_port, wait_http
from switchyard.config import MediaConfig
from switchyard.media.fetch import MediaTooLarge, MediaUnsupported
from switchyard.media.process import MediaProcessor, MediaQueueFull, _Stage


def _jpeg_with_exif(w: int = 1600, h: int = 800) -> bytes:
    """A JPEG whose EXIF says 'rotate 90°' and carries a GPS position."""
    img = Image.new("RGB", (w, h), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    exif[0x8825] = {1: "N", 2: (52.0, 31.0, 0.0)}  # GPS IFD
    out = io.BytesIO()
    img.save(out, "JPEG", exif=exif.tobytes())
    return out.getvalue()


def _data_uri(raw: bytes, kind: str = "image/jpeg") -> str:
    return f"data:{kind};base64,{base64.b64encode(raw).decode()}"


def _bomb_png(w: int = 100_000, h: int = 100_000) -> bytes:
    """A tiny PNG whose header claims w x h pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00"))
        + chunk(b"IEND", b"")
    )


def _decoded(uri: str) -> Image.Image:
    head, _, payload = uri.partition(",")
    assert head.startswith("data:image/jpeg;base64")
    return Image.open(io.BytesIO(base64.b64decode(payload)))


def test_an_image_is_oriented_resized_and_stripped_of_metadata() -> None:
    p = MediaProcessor(MediaConfig(max_side=512))
    try:
        out = asyncio.run(p.process(_data_uri(_jpeg_with_exif())))
    finally:
        p.close()
    assert out.size_in == (800, 1600)  # the EXIF orientation applied: portrait
    assert out.size_out == (256, 512)
    img = _decoded(out.data_uri)
    assert img.size == (256, 512)
    assert not img.getexif() and "exif" not in img.info
    assert set(out.timings_ms) == {"fetch", "decode", "resize", "encode"}


def test_a_decompression_bomb_is_refused_before_decoding() -> None:
    p = MediaProcessor(MediaConfig(max_pixels=10_000_000))
    try:
        with pytest.raises(MediaTooLarge):
            asyncio.run(p.process(_data_uri(_bomb_png(), "image/png")))
    finally:
        p.close()


@pytest.mark.parametrize("raw", [b"<svg></svg>", b"\x89PNG\r\n\x1a\n broken"])
def test_what_is_not_a_decodable_image_is_unsupported(raw: bytes) -> None:
    p = MediaProcessor(MediaConfig())
    try:
        with pytest.raises(MediaUnsupported):
            asyncio.run(p.process(_data_uri(raw, "image/png")))
    finally:
        p.close()


def test_a_full_stage_queue_refuses_at_once() -> None:
    p = MediaProcessor(MediaConfig())
    p.stages["decode"] = _Stage("decode", workers=1, queue=0)
    uri = _data_uri(_jpeg_with_exif(2400, 2400))

    async def burst() -> list[Any]:
        return await asyncio.gather(*(p.process(uri) for _ in range(3)), return_exceptions=True)

    try:
        results = asyncio.run(burst())
    finally:
        p.close()
    refused = [r for r in results if isinstance(r, MediaQueueFull)]
    assert len(refused) == 2 and refused[0].headers["Retry-After"] == "1"
    assert sum(1 for r in results if not isinstance(r, BaseException)) == 1


# -- end to end --------------------------------------------------------------------------


class _Images(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "image/jpeg")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    _Images.body = _jpeg_with_exif(1200, 600)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/photo.jpg"
    srv.shutdown()


@pytest.fixture(scope="module")
def vision(tmp_path_factory: Any) -> Iterator[tuple[Gateway, Path]]:
    import sys

    record = tmp_path_factory.mktemp("vision") / "received.jsonl"
    port = free_port()
    up = Proc(
        [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(port),
         "--record", str(record)],
        "scripted",
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/health", up)
    engine = {"kind": "openai", "base_url": f"http://127.0.0.1:{port}/v1"}
    g = start_gateway(
        {
            "models": [
                {"alias": "eyes", "engine": engine, "capabilities": {"supports_vision": True}},
                {
                    "alias": "thumbs",  # its own image settings over media's
                    "engine": engine,
                    "capabilities": {"supports_vision": True},
                    "media": {"max_side": 128, "format": "png"},
                },
                {"alias": "text", "engine": engine},
            ],
            "embeddings": {"enabled": False},
            "media": {
                "max_side": 512,
                "fetch": {"enabled": True, "allow_http": True, "allow_networks": ["127.0.0.1/32"]},
            },
        }
    )
    yield g, record
    g.proc.stop()
    up.stop()


def _chat(model: str, url: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }


def _last_image_received(record: Path) -> Image.Image:
    body = json.loads(record.read_text().strip().splitlines()[-1])
    return _decoded(body["messages"][0]["content"][1]["image_url"]["url"])


def test_a_data_uri_image_reaches_the_upstream_resized_and_clean(
    vision: tuple[Gateway, Path],
) -> None:
    gw, record = vision
    r = gw.post("/v1/chat/completions", json=_chat("eyes", _data_uri(_jpeg_with_exif())))
    assert r.status_code == 200, r.text
    img = _last_image_received(record)
    assert img.size == (256, 512) and not img.getexif()
    assert "media_decode;dur=" in r.headers["server-timing"]
    trace = httpx.get(gw.url + f"/admin/requests/{r.headers['x-request-id']}", headers=gw.admin)
    media = next(d for d in trace.json()["decisions"] if d["stage"] == "media")
    assert media["outcome"] == "processed"
    assert media["evidence"]["images"][0]["size_out"] == [256, 512]
    assert "base64" not in json.dumps(trace.json())  # no image bytes in the trace
    metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    assert 'switchyard_media_stage_seconds_count{stage="decode"}' in metrics
    row = next(u for u in gw.usage() if u["request_id"] == r.headers["x-request-id"])
    assert (row["images"], row["image_pixels_in"], row["image_pixels_out"]) == (
        1,
        1600 * 800,
        256 * 512,
    )
    assert row["image_bytes"] > 0


def test_a_url_image_is_fetched_safely_and_forwarded_inline(
    vision: tuple[Gateway, Path], images: str
) -> None:
    gw, record = vision
    r = gw.post("/v1/chat/completions", json=_chat("eyes", images))
    assert r.status_code == 200, r.text
    assert _last_image_received(record).size == (256, 512)  # 600x1200 after EXIF, resized


def test_blocked_urls_and_non_vision_models_are_refused(vision: tuple[Gateway, Path]) -> None:
    gw, _ = vision
    r = gw.post("/v1/chat/completions", json=_chat("eyes", "http://169.254.169.254/latest/"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_fetch_refused"
    metrics = httpx.get(gw.url + "/metrics", headers=gw.admin).text
    assert 'switchyard_media_refusals_total{code="media_fetch_refused"}' in metrics
    r = gw.post("/v1/chat/completions", json=_chat("text", _data_uri(_jpeg_with_exif())))
    assert r.status_code == 400 and "supports_vision" in r.json()["error"]["message"]
    many = _chat("eyes", "http://169.254.169.254/")
    many["messages"][0]["content"] *= 9  # nine images (and texts): refused before any fetch
    r = gw.post("/v1/chat/completions", json=many)
    assert r.status_code == 400 and r.json()["error"]["code"] == "media_too_large"


def test_the_media_cache_hits_for_the_same_bytes_of_one_tenant_only() -> None:
    p = MediaProcessor(MediaConfig(max_side=256))
    uri = _data_uri(_jpeg_with_exif(900, 300))

    async def three() -> list[Any]:
        return [
            await p.process(uri, "acme"),
            await p.process(uri, "acme"),
            await p.process(uri, "globex"),
        ]

    try:
        first, again, other = asyncio.run(three())
    finally:
        p.close()
    assert (first.cached, again.cached, other.cached) == (False, True, False)
    assert again.data_uri == first.data_uri and set(again.timings_ms) == {"fetch"}
    assert p.cache is not None and p.cache.bytes <= p.cache.max_bytes


def test_the_media_cache_stays_within_its_bytes() -> None:
    p = MediaProcessor(MediaConfig(max_side=64, cache_max_bytes=4000))
    uris = [_data_uri(_jpeg_with_exif(100 + i, 100)) for i in range(20)]

    async def many() -> None:
        for uri in uris:
            await p.process(uri, "acme")

    try:
        asyncio.run(many())
    finally:
        p.close()
    assert p.cache is not None and 0 < p.cache.bytes <= 4000


def test_bench_media_reports_every_stage(tmp_path: Path) -> None:
    from switchyard.cli import main

    out = tmp_path / "media.json"
    argv = ["bench", "media", "--images", "3", "--sizes", "512", "--workers", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["workers"], r["concurrency"]) for r in result["results"]] == [(1, 1), (1, 8)]
    first = result["results"][0]
    assert first["images"] == 3 and first["images_per_s"] > 0
    assert set(first["stages"]) == {"fetch", "decode", "resize", "encode"}
    assert result["peak_rss_mib"] > 0


def test_a_model_s_own_image_settings_apply(vision: tuple[Gateway, Path]) -> None:
    gw, record = vision
    r = gw.post("/v1/chat/completions", json=_chat("thumbs", _data_uri(_jpeg_with_exif())))
    assert r.status_code == 200, r.text
    body = json.loads(record.read_text().strip().splitlines()[-1])
    uri = body["messages"][0]["content"][1]["image_url"]["url"]
    assert uri.startswith("data:image/png;base64,")
    img = Image.open(io.BytesIO(base64.b64decode(uri.partition(",")[2])))
    assert img.size == (64, 128)


def test_the_request_deadline_covers_image_processing(vision: tuple[Gateway, Path]) -> None:
    gw, _ = vision
    big = _data_uri(_jpeg_with_exif(3840, 2160))
    r = gw.post(
        "/v1/chat/completions",
        json=_chat("eyes", big),
        headers={"x-request-timeout": "0.001"},
    )
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"


def test_bench_run_with_images_splits_the_media_time_by_step(
    vision: tuple[Gateway, Path], tmp_path: Path
) -> None:
    from switchyard.cli import main

    gw, _ = vision
    out = tmp_path / "run"
    code = main(
        [
            "bench", "run", "--endpoint", gw.url, "--model", "eyes", "--images", "2",
            "--concurrency", "1", "--num-requests", "3", "--output-len", "4",
            "--header", f"Authorization: Bearer {gw.key}",
            "--out", str(out), "--no-plots", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    summary = result["points"][0]["summary"]
    assert summary["completed"] == 3
    assert set(summary["media_ms"]) == {"fetch", "decode", "resize", "encode"}
    assert summary["media_ms"]["decode"]["max"] > 0  # the first; the rest hit the media cache
    assert result["metadata"]["workload"]["images"]["per_request"] == 2


def test_a_full_decode_queue_answers_429_at_once_end_to_end(tmp_path: Path) -> None:
    import sys
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    up = Proc(
        [sys.executable, "-m", "switchyard.bench.scripted_upstream", "--port", str(port)],
        "scripted",
    )
    wait_http(f"http://127.0.0.1:{port}/health", up)
    engine = {"kind": "openai", "base_url": f"http://127.0.0.1:{port}/v1"}
    gw = start_gateway(
        {
            "models": [
                {"alias": "eyes", "engine": engine, "capabilities": {"supports_vision": True}}
            ],
            "embeddings": {"enabled": False},
            "media": {"workers": 1, "queue": 0, "cache_max_bytes": 0},
        }
    )
    try:
        big = _chat("eyes", _data_uri(_jpeg_with_exif(3840, 2160)))
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: gw.post("/v1/chat/completions", json=big), range(6)))
    finally:
        gw.proc.stop()
        up.stop()
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    full = next(r for r in answers if r.status_code == 429)
    assert full.json()["error"]["code"] == "media_queue_full"
    assert full.headers["retry-after"] == "1"


def test_the_size_before_is_the_file_s_even_when_decoded_smaller() -> None:
    """A 4K JPEG is decoded at a reduced DCT scale; its recorded size is still 4K."""
    p = MediaProcessor(MediaConfig(max_side=512))
    img = Image.new("RGB", (3840, 2160), (10, 200, 10))
    raw = io.BytesIO()
    img.save(raw, "JPEG")
    try:
        out = asyncio.run(p.process(_data_uri(raw.getvalue())))
    finally:
        p.close()
    assert out.size_in == (3840, 2160) and out.size_out == (512, 288)
