"""The embeddings endpoint's own steps: which model the request names (checked
before any stage runs), then the embedding itself and its reply."""

from __future__ import annotations

import base64
import time
from typing import Any

from switchyard import outcomes
from switchyard.config import EmbeddingsConfig, Settings
from switchyard.embed import EmbeddingService
from switchyard.errors import InvalidRequest, ModelNotFound
from switchyard.pipeline import RequestContext
from switchyard.request import Embedding


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
        ctx.run.attempts = 1
        vecs, counts = await embedder.embed(texts)
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
