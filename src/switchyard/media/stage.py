"""The `media` stage: every image part of a chat request for a vision model, fetched
(or decoded from its data: URI), resized and re-encoded before the deployment's
queue, so the upstream receives images of the configured format and size, without
metadata, and the trace shows each image's shape and each step's time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from msgspec import structs

from switchyard import outcomes
from switchyard.config import ModelConfig
from switchyard.errors import MediaDeadlineExceeded, SwitchyardError
from switchyard.media.fetch import MediaTooLarge
from switchyard.media.process import STAGES, MediaProcessor, Processed, Settings
from switchyard.observe.metrics import Metrics
from switchyard.pipeline import RequestContext, Stage, Verdict, View


def image_urls(messages: list[dict[str, Any]] | None) -> list[tuple[int, int, str]]:
    """(message index, part index, url) of every image part of a chat's messages."""
    out = []
    for i, m in enumerate(messages or ()):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    image = part.get("image_url")
                    url = image.get("url") if isinstance(image, dict) else None
                    if isinstance(url, str):
                        out.append((i, j, url))
    return out


class Media(Stage):
    name = "media"
    NO_IMAGES = Verdict(outcomes.Media.SKIP, "the model takes no images")

    def __init__(self, processor: MediaProcessor, metrics: Metrics | None = None) -> None:
        self._processor = processor
        self._metrics = metrics

    def static(self, view: View) -> Verdict | None:
        model = view.model
        if view.endpoint != "chat.completions" or model is None:
            return self.NO_IMAGES
        return None if model.capabilities.supports_vision else self.NO_IMAGES

    def work(self, ctx: RequestContext) -> Awaitable[None] | None:
        parts = image_urls(ctx.generation.messages)
        if not parts:
            ctx.record(self.name, outcomes.Media.SKIP, "no image parts", time.perf_counter())
            return None
        most = self._processor.cfg.max_images
        if len(parts) > most:  # before any fetch or decode
            ctx.record(
                self.name,
                outcomes.Media.REJECT_TOO_LARGE,
                "too many images",
                time.perf_counter(),
            )
            raise MediaTooLarge(
                f"at most {most} images per request (media.max_images)", param="messages"
            )
        return self._process(ctx, parts)

    def _settings(self, model: ModelConfig | None) -> Settings:
        """The model's own image settings over media's defaults."""
        d = self._processor.defaults
        o = model.media if model is not None else None
        if o is None:
            return d
        return Settings(o.max_side or d.max_side, o.format or d.format, o.quality or d.quality)

    async def _process(self, ctx: RequestContext, parts: list[tuple[int, int, str]]) -> None:
        t = time.perf_counter()
        want = self._settings(ctx.model)
        tenant = ctx.principal.tenant_id
        try:
            try:
                async with asyncio.timeout(max(0.0, ctx.remaining_s())):  # the deadline covers it
                    done: list[Processed] = await asyncio.gather(
                        *(self._processor.process(url, tenant, want) for _, _, url in parts)
                    )
            except TimeoutError:
                raise MediaDeadlineExceeded(
                    "the request's deadline passed while its images were processed"
                ) from None
        except SwitchyardError as exc:
            if self._metrics is not None:
                self._metrics.media_refusals.labels(exc.code).inc()
            ctx.record(self.name, outcomes.reject(exc.code), exc.message, t, {"images": len(parts)})
            raise
        if self._metrics is not None:
            for p in done:
                for step, (_wait, work) in p.timings_ms.items():
                    self._metrics.media_stage.labels(step).observe(work / 1000)
        req = ctx.generation
        assert req.messages is not None  # image parts were found in them
        messages = list(req.messages)
        for (i, j, _), p in zip(parts, done, strict=True):
            message = dict(messages[i])
            content = list(message["content"])
            part = dict(content[j])
            image = dict(part["image_url"])
            image["url"] = p.data_uri
            part["image_url"] = image
            content[j] = part
            message["content"] = content
            messages[i] = message
        ctx.request = structs.replace(req, messages=messages)
        totals = {
            s: round(sum(p.timings_ms.get(s, (0.0, 0.0))[1] for p in done), 3) for s in STAGES
        }
        waits = {s: round(sum(p.timings_ms.get(s, (0.0, 0.0))[0] for p in done), 3) for s in STAGES}
        ctx.media_ms = totals
        ctx.media_shape = (
            len(done),
            sum(p.bytes_in for p in done),
            sum(p.size_in[0] * p.size_in[1] for p in done),
            sum(p.size_out[0] * p.size_out[1] for p in done),
        )
        ctx.record(
            self.name,
            outcomes.Media.PROCESSED,
            f"{len(done)} image(s) fetched, resized and re-encoded",
            t,
            {
                "images": [
                    {
                        "bytes_in": p.bytes_in,
                        "bytes_out": p.bytes_out,
                        "size_in": list(p.size_in),
                        "size_out": list(p.size_out),
                        "type": p.media_type,
                        "cache": "hit" if p.cached else "miss",
                    }
                    for p in done
                ],
                "stage_ms": totals,
                "queue_ms": waits,
            },
        )
