"""The sealing of stored responses (AES-256-GCM):
moved to state/sealing.py; this module keeps the old import path."""

from switchyard.state.sealing import (
    _NONCE,
    _VERSION,
    KEY_BYTES,
    Sealer,
    SealError,
)

__all__ = [
    "KEY_BYTES",
    "_NONCE",
    "_VERSION",
    "SealError",
    "Sealer",
]
