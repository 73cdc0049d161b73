"""Tool shortlisting: relevance with the real embedding model, and policy removal that
no score can override."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from switchyard.config import ToolsConfig
from switchyard.decide.tools import ToolVectorCache, shortlist, tool_name, tool_text
from switchyard.policy.tool_calls_governor import ToolPolicy

Embed = Callable[[list[str]], np.ndarray]

TOOL_SPECS = [
    ("get_weather", "Current weather and forecast for a city"),
    ("search_docs", "Search the product documentation"),
    ("send_email", "Send an email to a recipient"),
    ("create_calendar_event", "Create an event in the user's calendar"),
    ("list_invoices", "List the customer's invoices"),
    ("refund_payment", "Refund a card payment"),
    ("get_stock_price", "Latest stock price for a ticker symbol"),
    ("translate_text", "Translate text between languages"),
    ("run_sql_query", "Run a read-only SQL query on the analytics database"),
    ("create_github_issue", "Open an issue in a GitHub repository"),
    ("book_flight", "Book a flight between two airports"),
    ("find_restaurant", "Find restaurants near a location"),
    ("convert_currency", "Convert an amount between currencies"),
    ("get_directions", "Driving or walking directions between two places"),
    ("set_reminder", "Set a reminder at a given time"),
    ("play_music", "Play a song or playlist"),
    ("summarize_url", "Fetch a web page and summarize it"),
    ("generate_image", "Generate an image from a text prompt"),
    ("check_order_status", "Delivery status of an order"),
    ("update_shipping_address", "Change the shipping address of an order"),
    ("delete_account", "Permanently delete the user's account and all data"),
    ("transfer_funds", "Transfer money between bank accounts"),
    ("get_news", "Top news headlines on a topic"),
    ("calculate", "Evaluate a mathematical expression"),
    ("read_file", "Read a file from the workspace"),
    ("write_file", "Write a file in the workspace"),
    ("run_tests", "Run the project's unit tests"),
    ("get_user_profile", "The signed-in user's profile"),
    ("reset_password", "Send a password reset link"),
    ("lookup_word", "Dictionary definition of a word"),
]


def make_tool(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object"}},
    }


TOOLS = [make_tool(n, d) for n, d in TOOL_SPECS]


@pytest.fixture(scope="module")
def tool_vecs(embed: Embed) -> np.ndarray:
    return ToolVectorCache(embed).vectors(TOOLS)


@pytest.mark.parametrize(
    ("query", "relevant"),
    [
        ("Will it rain in Paris tomorrow?", "get_weather"),
        ("Where is my package? It should have arrived yesterday.", "check_order_status"),
        ("How many euros is 250 US dollars?", "convert_currency"),
        ("Remind me to call mum at 6pm", "set_reminder"),
    ],
)
def test_relevant_tool_kept_among_30(
    embed: Embed, tool_vecs: np.ndarray, query: str, relevant: str
) -> None:
    res = shortlist(
        TOOLS, embed([query])[0], tool_vecs, 5, None, ToolPolicy(ToolsConfig(shortlist_k=5))
    )
    assert relevant in res.kept and len(res.kept) == 5 and res.shortlisted
    assert len(res.dropped) == 25 and not res.removed
    assert res.candidates[0]["name"] == relevant
    assert [t["function"]["name"] for t in res.tools] == res.kept


def test_denied_tool_never_survives_even_when_it_scores_highest(
    embed: Embed, tool_vecs: np.ndarray
) -> None:
    q = embed(["Please delete my account and all my data permanently"])[0]
    open_cfg = ToolPolicy(ToolsConfig(shortlist_k=5))
    assert (
        shortlist(TOOLS, q, tool_vecs, 5, None, open_cfg).candidates[0]["name"] == "delete_account"
    )
    cfg = ToolPolicy(ToolsConfig(shortlist_k=5, deny=["delete_account"]))
    for k in (5, 30, None):  # with or without a shortlist
        res = shortlist(TOOLS, q, tool_vecs, k, None, cfg)
        assert "delete_account" not in res.kept
        assert "delete_account" not in [c["name"] for c in res.candidates]
        assert res.removed == [{"name": "delete_account", "reason": "denied by tools.deny"}]
    # Required (e.g. forced by tool_choice) does not override a denial either.
    res = shortlist(TOOLS, q, tool_vecs, 5, None, cfg, required={"delete_account"})
    assert "delete_account" not in res.kept


def test_tenant_allow_list_and_global_allow(embed: Embed, tool_vecs: np.ndarray) -> None:
    q = embed(["What's the weather in Rome?"])[0]
    cfg = ToolPolicy(
        ToolsConfig(shortlist_k=5, tenant_allow={"kiosk": ["search_docs", "lookup_word"]})
    )
    res = shortlist(TOOLS, q, tool_vecs, 5, "kiosk", cfg)
    assert res.kept == ["search_docs", "lookup_word"] and not res.shortlisted
    assert len(res.removed) == 28
    assert {r["reason"] for r in res.removed} == {"not in tools.tenant_allow['kiosk']"}
    other = shortlist(TOOLS, q, tool_vecs, 5, "acme", cfg)  # no list: unrestricted
    assert "get_weather" in other.kept and not other.removed
    glob = ToolPolicy(ToolsConfig(allow=["get_weather", "get_news"]))
    res = shortlist(TOOLS, q, tool_vecs, None, "acme", glob)
    assert res.kept == ["get_weather", "get_news"]
    assert res.removed[0]["reason"] == "not in tools.allow"


def test_a_registry_entry_for_other_tenants_is_removed_as_the_reply_gate_would(
    embed: Embed, tool_vecs: np.ndarray
) -> None:
    """The request side removes what the reply's gate would block: a registered tool
    whose `allowed_tenants` leaves the tenant out (one rule, `ToolPolicy.refusal`)."""
    q = embed(["What's the weather in Rome?"])[0]
    spec = {"name": "get_weather", "class": "read_only", "allowed_tenants": ["bank"]}
    policy = ToolPolicy(ToolsConfig.model_validate({"registry": [spec]}))
    res = shortlist(TOOLS, q, tool_vecs, None, "acme", policy, required={"get_weather"})
    assert "get_weather" not in res.kept and len(res.kept) == len(TOOLS) - 1
    assert res.removed == [
        {"name": "get_weather", "reason": "not in tools.registry['get_weather'].allowed_tenants"}
    ]
    assert "get_weather" in shortlist(TOOLS, q, tool_vecs, None, "bank", policy).kept


def unit(i: int, n: int = 4) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(n)]


def test_top_k_ties_keep_request_order_and_required_tools() -> None:
    tools = [make_tool(f"t{i}", "") for i in range(4)]
    vecs = np.array([unit(0), unit(1), unit(1), unit(3)], dtype=np.float32)
    q = np.array(unit(1), dtype=np.float32)
    res = shortlist(tools, q, vecs, 1, None, ToolPolicy(ToolsConfig()))
    assert res.kept == ["t1"] and res.dropped == ["t2", "t0", "t3"]  # tie: request order
    res = shortlist(tools, q, vecs, 2, None, ToolPolicy(ToolsConfig()), required={"t3"})
    assert res.kept == ["t1", "t3"]
    assert json.loads(json.dumps(res.evidence()))["candidates"][0] == {"name": "t1", "score": 1.0}
    assert res.outcome == "tools:2/4"


def test_without_vectors_the_shortlist_fails_open_but_policy_does_not() -> None:
    tools = [make_tool(f"t{i}", "") for i in range(4)]
    res = shortlist(tools, None, None, 2, None, ToolPolicy(ToolsConfig(deny=["t0"])))
    assert res.kept == ["t1", "t2", "t3"] and not res.shortlisted
    assert "no vectors to score" in res.reason and "1 removed by policy" in res.reason


def test_tool_text_and_name_for_both_shapes() -> None:
    assert tool_text(make_tool("get_weather", " Weather now ")) == "get weather: Weather now"
    legacy = {"name": "list-invoices", "description": "All invoices"}
    assert (
        tool_text(legacy) == "list invoices: All invoices" and tool_name(legacy) == "list-invoices"
    )
    assert tool_text({"type": "function", "function": {"name": "ping"}}) == "ping"
    nameless = shortlist([{"type": "function"}], None, None, None, None, ToolPolicy(ToolsConfig()))
    assert nameless.removed == [{"name": "#0", "reason": "tool has no function name"}]


class CountingEmbed:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        return np.array([[float(len(t)), 1.0] for t in texts], dtype=np.float32)


def test_vector_cache_embeds_each_tool_once_and_evicts_lru() -> None:
    emb = CountingEmbed()
    cache = ToolVectorCache(emb, max_entries=3)
    a, b, c, d = (make_tool(n, "x") for n in ("a", "bb", "ccc", "dddd"))
    first = cache.vectors([a, b, a])
    assert emb.calls == [["a: x", "bb: x"]]
    assert first.shape == (3, 2) and first[0][0] == first[2][0] == 4.0
    schema_change = {"type": "function", "function": {**a["function"], "parameters": {}}}
    cache.vectors([schema_change, b])
    assert len(emb.calls) == 1 and cache.hits == 2 and cache.misses == 2
    cache.vectors([c, d])  # evicts the least recently used: a
    assert emb.calls[-1] == ["ccc: x", "dddd: x"] and len(cache) == 3
    cache.vectors([a])
    assert emb.calls[-1] == ["a: x"]
    assert cache.missing([a, b, c]) == ["bb: x"]
