"""The text a shadow-verified cache hit is compared by is choice 0's, wherever an
upstream put it in `choices` (before: `choices[0]`, so a reply with its choices out of
order compared choice 1's text)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from switchyard.decide.stages_cache import reply_text

TEXTS = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4, unique=True)


@given(TEXTS, st.randoms(use_true_random=False), st.booleans())
def test_reply_text_is_choice_zeros_in_any_order(texts: list[str], rng: object, chat: bool) -> None:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": t}}
        if chat
        else {"index": i, "text": t}
        for i, t in enumerate(texts)
    ]
    rng.shuffle(choices)  # type: ignore[attr-defined]
    assert reply_text({"choices": choices}) == texts[0]


def test_reply_text_of_a_reply_without_choice_zero_is_empty() -> None:
    assert reply_text({"choices": [{"index": 1, "message": {"content": "b"}}]}) == ""
    assert reply_text({"choices": []}) == ""
    assert reply_text({}) == ""
