"""The semantic router, built after start once the embedding model has loaded (the
route examples are embedded with it)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from switchyard.config import Settings
from switchyard.embed import EmbeddingService

log = logging.getLogger("switchyard")


async def build_router(settings: Settings, embedder: EmbeddingService | None) -> Any:
    """Embed the route examples once the embedding model is loaded; None (the default
    route for every request) when there is no embedding model to embed them with."""
    from switchyard.decide.router import Router

    if embedder is None:
        log.error("router.enabled needs embeddings.enabled; routing uses the default route")
        return None
    while embedder.state == "loading":
        await asyncio.sleep(0.1)
    if not embedder.ready:
        log.error("router disabled: the embedding model failed to load")
        return None
    loop = asyncio.get_running_loop()
    router = await loop.run_in_executor(
        None, lambda: Router(settings.router, lambda texts: embedder.encode(texts)[0])
    )
    log.info("router ready: %d routes", len(settings.router.routes))
    return router
