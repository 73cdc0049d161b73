"""The sealing of stored responses: AES-256-GCM from `cryptography`.

A sealed body is a version byte, a fresh 96-bit nonce from the OS's CSPRNG (entropy.py:
never handed out twice, in this process or a fork of it) and the ciphertext of the
body's JSON with its 16-byte tag; the tenant and the response id are its associated
data, so a blob opens only under its own (tenant, id): one copied under another tenant
or id, sealed with another key, or altered, does not open (`SealError`).

The gateway seals what it updates; new responses are sealed by the ledger's writer
process (observe/ledger_writer.py), which gets the key as the first frame down its
pipe, or, a writer shared by several gateway processes, down each gateway's connection
(each connection's responses sealed with that connection's key): never on a command
line or in an environment. Where the key comes from: state/responses.py.
"""

from __future__ import annotations

from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from switchyard.entropy import RandomPool

_VERSION = b"\x01"
_NONCE = 12
KEY_BYTES = 32


class SealError(Exception):
    """A stored body that does not open: sealed with another key, for another tenant or
    id, or altered."""


class Sealer:
    """AES-256-GCM over a body's JSON, a fresh random 96-bit nonce per seal, the tenant
    and id as associated data: a blob opens only under its own (tenant, id)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError("the key of stored responses is 32 bytes (AES-256)")
        self.key = key  # handed to the ledger's writer process, which seals new ones
        self._aead = AESGCM(key)
        self._nonces = RandomPool()  # each nonce once, in this process and any fork

    @staticmethod
    def _aad(tenant_id: str, rid: str) -> bytes:
        return f"{tenant_id}\0{rid}".encode()

    def seal(self, tenant_id: str, rid: str, obj: dict[str, Any]) -> bytes:
        return self.seal_json(tenant_id, rid, orjson.dumps(obj))

    def seal_json(self, tenant_id: str, rid: str, data: bytes) -> bytes:
        """A body already serialised (`data`, its JSON) sealed."""
        nonce = self._nonces.take(_NONCE)
        return _VERSION + nonce + self._aead.encrypt(nonce, data, self._aad(tenant_id, rid))

    def open(self, tenant_id: str, rid: str, blob: bytes) -> dict[str, Any]:
        blob = bytes(blob)
        if len(blob) < 1 + _NONCE + 16 or blob[:1] != _VERSION:
            raise SealError(f"stored response {rid}: not a sealed body")
        nonce, sealed = blob[1 : 1 + _NONCE], blob[1 + _NONCE :]
        try:
            data = self._aead.decrypt(nonce, sealed, self._aad(tenant_id, rid))
        except InvalidTag:
            raise SealError(
                f"stored response {rid} does not open with this gateway's key: sealed with "
                "another key (responses.encryption_key_env, responses.key), for another "
                "tenant or id, or altered"
            ) from None
        obj = orjson.loads(data)
        if not isinstance(obj, dict):
            raise SealError(f"stored response {rid}: the body is not an object")
        return obj
