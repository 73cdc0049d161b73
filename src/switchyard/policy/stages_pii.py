"""The PII stage: masks a request's personal data on the way in (policy/pii.py) and
restores the request's own values in the reply on the way out (policy/pii_reply.py).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from switchyard import outcomes
from switchyard.config import Settings
from switchyard.errors import PiiDetected, PiiFailure
from switchyard.pipeline import (
    CacheOutcome,
    PiiState,
    ReplyPart,
    RequestContext,
    Stage,
    Verdict,
    View,
)
from switchyard.policy.pii import MaskingError, PiiMasker, mask_request
from switchyard.policy.pii_reply import PiiRestore, request_session
from switchyard.request import Embedding

# Read on every request's path: an enum member read through its class costs a
# metaclass lookup each time.
_REPLAY = CacheOutcome.REPLAY


def _failed(ctx: RequestContext, what: str, exc: MaskingError, t: float) -> PiiFailure:
    """The refusal of a request whose PII `what` (masking, detection) failed: fail
    closed, the decision naming only the failure's kind."""
    ctx.record("pii", outcomes.Pii.REJECT_MASKING_FAILED, f"{what} failed: {type(exc).__name__}", t)
    return PiiFailure(f"PII {what} failed; the request was refused (fail closed)")


def _refused(
    ctx: RequestContext, found: dict[str, int], evidence: dict[str, Any], t: float
) -> PiiDetected:
    """The refusal of a request holding PII where the mode is `block`: the decision's
    evidence says the types and counts found, never the values."""
    kinds = sorted(found)
    ctx.record("pii", outcomes.Pii.REJECT_PII_DETECTED, f"request contains {kinds}", t, evidence)
    return PiiDetected(
        f"the request contains personal data ({', '.join(kinds)}) and this model does not accept it"
    )


class Pii(Stage):
    """Mask PII once; the masked text is what cache keys, embeddings and traces see.
    On the way out, restore the request's own values wherever the reply carries
    placeholders (policy/pii_reply.py)."""

    name = "pii"
    NOTHING_STORED = Verdict(
        outcomes.Pii.SKIP, "observe_only and no cache or router: no text is stored"
    )

    def __init__(self, settings: Settings, masker: PiiMasker, cache_on: bool) -> None:
        self._mode = settings.pii.mode
        self._modes = dict(settings.pii.models)
        # Masked text feeds only the cache and the router; with neither, nothing here
        # stores or forwards request text, so there is nothing to mask.
        self._text_kept = cache_on or settings.router.enabled
        self._masker = masker
        # Aliases whose placement keeps PII on the device: found PII is needed there.
        self._placed = {
            m.alias
            for m in settings.models
            if m.placement is not None and m.placement.pii_stays_local
        }

    def static(self, view: View) -> Verdict | None:
        mode = self._modes.get(view.alias or "", self._mode)
        if mode == "observe_only" and not self._text_kept and view.alias not in self._placed:
            return self.NOTHING_STORED
        return None

    def work(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        mode = self._modes.get(ctx.alias or "", self._mode)
        session = self._masker.session()
        try:
            masked = mask_request(session, ctx.generation)
        except MaskingError as exc:
            raise _failed(ctx, "masking", exc, t) from None
        found = dict(session.found)
        evidence = {"mode": mode, "found": found}
        if found and mode == "block":
            raise _refused(ctx, found, evidence, t)
        restore = bool(found) and mode == "mask_upstream"
        ctx.pii = PiiState(session, masked, restore, found)
        if restore:
            ctx.request = masked  # the upstream sees placeholders; the reply is restored
        outcome = (
            (outcomes.Pii.MASKED if mode == "mask_upstream" else outcomes.Pii.OBSERVED)
            if found
            else outcomes.Pii.CLEAN
        )
        ctx.record("pii", outcome, f"{sum(found.values())} PII value(s) found", t, evidence)

    def reply(self, ctx: RequestContext) -> ReplyPart | None:
        """Restoring, when the reply can carry this request's placeholders: the
        upstream saw them (mask_upstream), or the reply was stored masked (a cache hit,
        an idempotent replay)."""
        pii = ctx.pii
        if pii is not None:
            return PiiRestore(pii.session) if pii.restore or ctx.response is not None else None
        if ctx.cache is _REPLAY:
            return PiiRestore(request_session(self._masker, ctx), only_marked=True)
        return None


class EmbeddingsPii(Stage):
    """`pii.mode: block` for an embeddings request, over its inputs and its `user`:
    one holding PII is refused (400 `pii_detected`), as a generation is; the PII
    found is evidence by type and count, never the values (execute/embeddings.py
    `pii_stages` says when the stage is in the pipeline)."""

    name = "pii"

    def __init__(self, masker: PiiMasker) -> None:
        self._masker = masker

    def work(self, ctx: RequestContext) -> None:
        t = time.perf_counter()
        req = ctx.request
        assert isinstance(req, Embedding)
        texts = req.texts if req.user is None else [*req.texts, req.user]
        found: Counter[str] = Counter()
        try:
            for text in texts:
                found.update(kind for _, _, kind in self._masker.find(text))
        except MaskingError as exc:
            raise _failed(ctx, "detection", exc, t) from None
        evidence = {"mode": "block", "found": dict(found)}
        if found:
            raise _refused(ctx, found, evidence, t)
        ctx.record("pii", outcomes.Pii.CLEAN, "0 PII value(s) found", t, evidence)
