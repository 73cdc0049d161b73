"""The semantic side: the embedding service, the response cache, the checks a
semantic cache candidate must pass, and the router built over the embeddings.

Each is optional (embeddings.enabled, cache.enabled, cache.semantic, router.enabled);
a factory returns None where its capability is off. The router is built after start,
once the embedding model has loaded, by the control plane (control/router.py).
"""

from __future__ import annotations

from collections.abc import Callable

from switchyard.config import Settings
from switchyard.decide.cache import ResponseCache
from switchyard.decide.candidate import CandidateCheck
from switchyard.decide.candidate import from_config as candidate_check
from switchyard.decide.shadow_threshold import PartitionThresholds
from switchyard.embed import EmbeddingService
from switchyard.state.choose import build_cache_share


def build_embedder(settings: Settings, idle: Callable[[], bool]) -> EmbeddingService | None:
    """The one embedding service (embed.py); `idle`: whether the gateway is quiet enough
    for its background work."""
    return EmbeddingService(settings.embeddings, idle=idle) if settings.embeddings.enabled else None


def build_cache(settings: Settings, embedder: EmbeddingService | None) -> ResponseCache | None:
    """The response cache (decide/cache.py), shared through Redis when cache.shared and
    storage.redis_url are set."""
    c = settings.cache
    cache = (
        ResponseCache(
            c.max_entries,
            c.max_bytes,
            dimensions=_dimensions(embedder),
            thresholds=PartitionThresholds(c.shadow_feedback),
        )
        if c.enabled
        else None
    )
    # The shared entries wrap the cache they share (a true cycle): set on the built
    # cache; state/choose.py picks Redis or none.
    if cache is not None:
        cache.share = build_cache_share(settings, cache)
    return cache


def _dimensions(embedder: EmbeddingService | None) -> Callable[[], int | None]:
    """The embedder's vector size once its model has loaded (None before, or without one)."""
    return lambda: embedder.dimensions if embedder is not None else None


def build_candidates(settings: Settings, cache: ResponseCache | None) -> CandidateCheck | None:
    """The checks a semantic candidate must pass (decide/candidate.py), when the cache
    is on and semantic; a background build may complete them (decide/encoder_build.py)."""
    c = settings.cache
    return candidate_check(c, settings.embeddings) if cache is not None and c.semantic else None
