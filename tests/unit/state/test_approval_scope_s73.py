"""What consuming an approval token says depends only on what the caller's tenant may
know: another tenant's token is "unknown", as a token that does not exist (before:
"the approval is for another tenant, task or call", telling a holder of a leaked
token that it is real). A mismatch within the tenant still names the task or call."""

from __future__ import annotations

from switchyard.state.approvals import ApprovalStore
from switchyard.state.store import memory_connection


def test_another_tenants_token_is_unknown_and_stays_usable() -> None:
    store = ApprovalStore(memory_connection())
    token = store.issue("tenant-a", "task-1", "call-1", "ops", 60.0)["token"]
    unknown = store.consume("not-a-token", "tenant-b", "task-1", "call-1", "r0")
    assert store.consume(token, "tenant-b", "task-1", "call-1", "r1") == unknown
    assert unknown == (None, "unknown approval token")
    # Within the tenant a mismatch is named, and the token is not used up by either.
    assert store.consume(token, "tenant-a", "task-1", "call-2", "r2") == (
        None,
        "the approval is for another task or call",
    )
    assert store.consume(token, "tenant-a", "task-1", "call-1", "r3") == ("ops", None)
