"""`switchyard bench media`: the image preprocessing stages on their own.

For each image size (512x512 and 4K by default, a JPEG with EXIF made here) and each
worker count, `--images` images are processed at concurrency 1 and 8 through the
same `MediaProcessor` the gateway uses, from data: URIs (no network) and with the
media cache off (every image is decoded, resized and encoded). It reports, per
stage, the median and p95 queue wait and service time, the images per second, and
the process's peak RSS; the baseline in the same run is concurrency 1 on one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import resource
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from switchyard.config import MediaConfig
from switchyard.media.process import STAGES, MediaProcessor, Processed

SIZES = {"512": (512, 512), "4k": (3840, 2160)}


def make_image(w: int, h: int) -> str:
    """A w x h JPEG with EXIF as a data: URI (a gradient, so encoders have work)."""
    from PIL import Image

    img = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 1
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, exif=exif.tobytes())
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def _run(uri: str, workers: int, concurrency: int, n: int, max_side: int) -> dict[str, Any]:
    p = MediaProcessor(MediaConfig(max_side=max_side, cache_max_bytes=0), workers=workers)
    done: list[Processed] = []
    pending = iter(range(n))

    async def client() -> None:
        for _ in pending:
            done.append(await p.process(uri))

    try:
        await p.process(uri)  # warm-up: thread start, codec tables
        t = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t
    finally:
        p.close()
    stages: dict[str, Any] = {}
    for s in STAGES:
        waits = [d.timings_ms[s][0] for d in done]
        work = [d.timings_ms[s][1] for d in done]
        stages[s] = {
            "wait_ms_p50": round(statistics.median(waits), 3),
            "wait_ms_p95": round(_pct(waits, 0.95), 3),
            "work_ms_p50": round(statistics.median(work), 3),
            "work_ms_p95": round(_pct(work, 0.95), 3),
        }
    return {
        "workers": workers,
        "concurrency": concurrency,
        "images": len(done),
        "images_per_s": round(len(done) / elapsed, 2),
        "stages": stages,
    }


def run(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    lines = [f"media preprocessing, {args.images} images per point, max_side {args.max_side}"]
    for name in args.sizes:
        w, h = SIZES[name]
        uri = make_image(w, h)
        base_rate = None
        for workers in args.workers:
            for conc in (1, 8):
                r = asyncio.run(_run(uri, workers, conc, args.images, args.max_side))
                r["size"] = name
                base_rate = base_rate or r["images_per_s"]
                r["ratio_vs_first"] = round(r["images_per_s"] / base_rate, 2)
                results.append(r)
                st = r["stages"]
                lines.append(
                    f"  {name:>4} workers={workers} c={conc}: {r['images_per_s']:7.1f} img/s "
                    f"(x{r['ratio_vs_first']:.2f})  "
                    + "  ".join(
                        f"{s} {st[s]['work_ms_p50']:.1f}+{st[s]['wait_ms_p50']:.1f}ms"
                        for s in ("decode", "resize", "encode")
                    )
                )
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines.append(f"  peak RSS {peak_mib:.0f} MiB  (stage: service+queue, medians)")
    print("\n".join(lines))
    out = Path(args.out or f"bench-results/media-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "bench": "media",
                "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": {
                    "cpu_count": os.cpu_count(),
                    "python": platform.python_version(),
                    "pillow": metadata.version("pillow"),
                },
                "workload": {"images": args.images, "sizes": args.sizes, "max_side": args.max_side},
                "results": results,
                "peak_rss_mib": round(peak_mib, 1),
            },
            indent=2,
        )
    )
    print(f"results: {out}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=40, help="images per point")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["512", "4k"])
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--max-side", type=int, default=1024)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
