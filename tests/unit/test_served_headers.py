"""The rate-limit headers of a reply, as `reply.served_raw_headers` encodes them.

It encodes them with the default codec rather than latin-1 (the codec HTTP header
bytes are read in), which gives the same bytes only because `policy/admit.rate_headers`
writes ASCII. The property: for any limiter state, the encoded headers are exactly
the latin-1 bytes of the names and values `rate_headers` gave, in its order.
"""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from switchyard.policy.admit import rate_headers
from switchyard.policy.auth import ANONYMOUS
from switchyard.policy.headers import opened
from switchyard.reply import served_raw_headers
from switchyard.state.limits import Verdict

_COUNTS = st.floats(min_value=-1e12, max_value=1e18, allow_nan=False)
_RESETS = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e9, max_value=1e12)
# A scope reports each kind of limit whole (its limit, what is left, when it resets),
# or not at all, as the limiters do.
_REQUESTS = st.fixed_dictionaries(
    {"limit_requests": _COUNTS, "remaining_requests": _COUNTS, "reset_requests_s": _RESETS}
)
_TOKENS = st.fixed_dictionaries(
    {"limit_tokens": _COUNTS, "remaining_tokens": _COUNTS, "reset_tokens_s": _RESETS}
)
_SCOPE = st.builds(
    lambda r, t: {**(r or {}), **(t or {})}, st.none() | _REQUESTS, st.none() | _TOKENS
)


@given(st.dictionaries(st.sampled_from(["key:a", "tenant:t", "deployment:m"]), _SCOPE))
def test_rate_headers_go_out_as_their_latin1_bytes(state: dict[str, dict[str, float]]) -> None:
    ctx = opened("req_1", "chat.completions", {}, time.perf_counter(), 60.0, ANONYMOUS)
    ctx.admission.rate_headers = rate_headers(Verdict(True, state=state))
    expected = [
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in ctx.admission.rate_headers.items()
    ]
    raw = served_raw_headers(ctx)
    assert raw[0] == (b"x-request-id", b"req_1")
    assert raw[1:] == expected
