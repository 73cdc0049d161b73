"""The embeddings endpoint's own steps: which model the request names (checked
before any stage runs), its PII decision (a stage of the embeddings pipeline), then
the embedding itself, within the request's deadline, and its reply."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from switchyard import outcomes
from switchyard.config import EmbeddingsConfig, Settings
from switchyard.embed import EmbeddingService
from switchyard.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
)
from switchyard.pipeline import RequestContext, Stage
from switchyard.policy.pii import PiiMasker
from switchyard.policy.stages_pii import EmbeddingsPii
from switchyard.request import Embedding


def pii_stages(settings: Settings, masker: PiiMasker) -> list[Stage]:
    """The embeddings pipeline's PII stage: where `pii.mode` (or the embedding alias's
    own in `pii.models`) is `block`, one that refuses a request holding PII. The other
    modes need none: the texts are embedded as sent, since the embedder runs in the
    gateway's own process (nothing goes upstream), nothing of the request is stored,
    and a vector of placeholders would not mean what the text means
    (docs/guides/embeddings.md)."""
    pii = settings.pii
    mode = pii.models.get(settings.embeddings.alias, pii.mode)
    return [EmbeddingsPii(masker)] if mode == "block" else []


class Embeddings:
    """Validates and runs `/v1/embeddings` requests on the gateway's embedder."""

    def __init__(self, settings: Settings, embedder: EmbeddingService | None) -> None:
        self._settings = settings
        self._cfg: EmbeddingsConfig = settings.embeddings
        self._embedder = embedder

    def validate(self, ctx: RequestContext, req: Embedding) -> list[str]:
        """The inputs of a shape-checked request (its alias set on `ctx`) if this
        gateway serves its model; raises the refusal."""
        cfg = self._cfg
        model, texts = req.model, req.texts
        ctx.request = req
        embedder = self._embedder
        if embedder is None or model != cfg.alias:
            if self._settings.model(model) is not None:
                raise InvalidRequest(
                    f"the model '{model}' does not serve embeddings", param="model"
                )
            raise ModelNotFound(
                f"the embedding model '{model[:128]}' does not exist", param="model"
            )
        ctx.alias = model
        dims = req.dimensions
        if dims is not None and embedder.dimensions is not None and dims != embedder.dimensions:
            raise InvalidRequest(
                f"'dimensions' must be {embedder.dimensions} for {model}", param="dimensions"
            )
        return texts

    async def run(self, ctx: RequestContext, texts: list[str]) -> dict[str, Any]:
        """The reply: one vector per input, as floats or base64 (`encoding_format`)."""
        embedder = self._embedder
        assert embedder is not None  # validate refused the request otherwise
        req = ctx.request
        assert isinstance(req, Embedding)
        dims = req.dimensions
        t = time.perf_counter()
        left = ctx.remaining_s()
        if left <= 0:
            raise DeadlineExceeded("the request deadline passed before its inputs were embedded")
        ctx.run.attempts = 1
        try:
            # Past the deadline the caller is answered at once; a batch already in the
            # embedder's worker finishes there, its vectors dropped (nothing came back:
            # nothing is billed).
            vecs, counts = await asyncio.wait_for(
                embedder.embed(texts, ctx.principal.tenant_id), left
            )
        except TimeoutError:
            raise DeadlineExceeded(
                f"the request deadline passed while {len(texts)} input(s) were embedded"
            ) from None
        if dims is not None and dims != vecs.shape[1]:  # the model loaded meanwhile
            raise InvalidRequest(
                f"'dimensions' must be {vecs.shape[1]} for {ctx.alias}", param="dimensions"
            )
        tokens = sum(counts)
        ctx.record(
            "embed",
            outcomes.Embed.OK,
            f"embedded {len(texts)} input(s)",
            t,
            {"inputs": len(texts), "tokens": tokens, "dimensions": int(vecs.shape[1])},
        )
        b64 = req.encoding_format == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.tobytes()).decode() if b64 else v.tolist(),
            }
            for i, v in enumerate(vecs)
        ]
        ctx.run.usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": ctx.alias, "usage": ctx.run.usage}
