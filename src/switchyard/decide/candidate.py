"""The checks a semantic-cache candidate above the threshold must pass, in one place:
the gateway's cache stage, `switchyard cache calibrate` and `bench cache` run this
same chain, so what is measured is what is served.

In order of cost, each check only seeing what the one before let through: the rules
(decide/verify.py, microseconds), the learned pair model (decide/pair_model.py, a dot
product) and the cross-encoder (decide/pair_encoder.py, one forward pass, ~2 ms). The
first veto ends the chain and is the decision's reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from switchyard.config import CacheConfig, EmbeddingsConfig
from switchyard.decide.pair_encoder import EncoderMissing, PairEncoder, chain_name
from switchyard.decide.pair_encoder import shipped as shipped_encoder
from switchyard.decide.pair_model import PairModel
from switchyard.decide.pair_model import shipped as shipped_model
from switchyard.decide.verify import verify
from switchyard.decide.verify import warm as warm_word_lists

log = logging.getLogger("switchyard.cache")


@dataclass
class CandidateCheck:
    rules: bool
    model: PairModel | None
    encoder: PairEncoder | None
    # Why semantic hits cannot be served at all (the encoder was asked for but is not
    # built): such a gateway serves exact hits only, and says so in each decision.
    unavailable: str | None = None
    # The encoder was asked for and is not built: the gateway builds it in the
    # background (gateway/) and then completes this check with `attach`.
    missing: bool = False

    def attach(self, encoder: PairEncoder) -> None:
        """The encoder is built now: semantic hits are served from here on (the one
        change this object sees after start; the encoder first, then the flag)."""
        self.encoder = encoder
        self.missing = False
        self.unavailable = None

    def __call__(self, new: str, cached: str, cosine: float) -> tuple[bool, str]:
        """(serve, why) for the request's text `new` against the cached entry's."""
        if self.unavailable is not None:
            return False, f"veto: {self.unavailable}"
        why = "no checks configured"
        if self.rules:
            ok, why = verify(new, cached)
            if not ok:
                return ok, why
        if self.model is not None:
            ok, why = self.model.verify(new, cached, cosine)
            if not ok:
                return ok, why
        if self.encoder is not None:
            return self.encoder.verify(cached, new, cosine)
        return True, why

    def describe(self) -> str:
        if self.unavailable is not None:
            return f"semantic hits off: {self.unavailable}"
        parts = [
            name
            for name, on in (
                ("rules", self.rules),
                ("pair model", self.model is not None),
                ("cross-encoder", self.encoder is not None),
            )
            if on
        ]
        return " + ".join(parts) or "none"


def from_config(cfg: CacheConfig, embeddings: EmbeddingsConfig) -> CandidateCheck:
    """The configured chain. A missing cross-encoder does not fall back to the weaker
    checks (a false hit is worse than a slow miss): semantic hits are off, and logged."""

    encoder = None
    unavailable = None
    if cfg.verify:  # the rules' word lists, built before the first request needs them
        warm_word_lists()
    if cfg.verify_encoder:
        try:
            encoder = load_encoder(cfg, embeddings)
        except EncoderMissing as exc:
            unavailable = str(exc)
            log.warning("semantic cache hits are off: %s", exc)
    return CandidateCheck(
        rules=cfg.verify,
        model=shipped_model() if cfg.verify_model else None,
        encoder=encoder,
        unavailable=unavailable,
        missing=unavailable is not None,
    )


def load_encoder(cfg: CacheConfig, embeddings: EmbeddingsConfig) -> PairEncoder:
    """The built cross-encoder for this chain; EncoderMissing if it is not built."""
    from switchyard.embed import cache_dir

    return shipped_encoder(str(cache_dir(embeddings)), chain_name(cfg.verify, cfg.verify_model))
