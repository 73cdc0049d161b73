"""Stored responses of the Responses API: moved to state/responses.py; this module keeps the old
import path."""

from switchyard.state.responses import (
    _COLUMNS,
    IN_FLIGHT,
    KEY_FILE,
    MAX_QUEUED,
    ORPHAN_REASON,
    ResponseStore,
    Sealer,
    SealError,
    StoredResponse,
    _decode_key,
    _key_file,
    _read_key_file,
    encode_key,
    enforce_response_retention,
    instance_name,
    key_home,
    log,
    new_response_id,
)

__all__ = [
    "IN_FLIGHT",
    "KEY_FILE",
    "MAX_QUEUED",
    "ORPHAN_REASON",
    "_COLUMNS",
    "ResponseStore",
    "SealError",
    "Sealer",
    "StoredResponse",
    "_decode_key",
    "_key_file",
    "_read_key_file",
    "encode_key",
    "enforce_response_retention",
    "instance_name",
    "key_home",
    "log",
    "new_response_id",
]
