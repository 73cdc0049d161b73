"""Training pairs made by construction for the cache's cross-encoder (pair_encoder.py).

The writers' pairs teach the cross-encoder what changes an answer, but they hold few
misspellings and few ways of putting one question, so it took an unseen typo or a
question turned into a request for a different question. Each training pair here gets
variants whose label follows from how they were made:

- a slip of the fingers (a letter dropped, doubled, swapped with its neighbour, or a
  key's neighbour struck), a vowel for another, a lower-cased unpunctuated copy,
  apostrophes dropped, a British spelling for an American one or the reverse, a
  common mix-up ("than" / "then", "capitol"), an article or "is" left out, "whats"
  for "what is", digits for a number word, two words run together: one question,
  misspelt, so the pair keeps its label;
- a rewording of its structure: a question put as a request ("How do I X?" / "Tell me
  how to X."), a request as a question, the question moved before its context, a
  greeting or thanks added, a synonym for a plain word: the same question again.

Numbers, negations, names (capitalised words and the rules' known entities) and the
rules' listed words (dates, units, direction and scope words) are never touched, so a
trap stays a trap and a paraphrase a paraphrase. Variants are for training only: the
cut is chosen, and every figure reported, on the writers' pairs alone. The shipped
recipe has them off (`VARIANT_SHARE` in pair_encoder.py): measured, they lowered the
validation set's recall at its false-hit limit, as a typo and a trap are both a
one-word difference; the rules' respelling tells those apart with a dictionary.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from switchyard.decide import verify

Pair = dict[str, Any]

_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
_VOWELS = frozenset("aeiou")
# Words a slip or a synonym must leave as they are: what the rules compare.
_PROTECTED = (
    verify._NEGATIONS
    | verify._NUMBERS_WRITTEN
    | verify._KNOWN_ENTITIES
    | verify._LISTED
    | verify._STOP
    | frozenset(verify._ENTITY_ALIASES)
    | frozenset(("dont", "doesnt", "didnt", "cant", "wont", "isnt", "arent", "cannot"))
    | frozenset(w for w, full in verify._BARE_CONTRACTIONS.items() if "not" in full)
    | frozenset(("percent", "cent"))  # "per cent" is "%"
)
_AMERICAN = {american: british for british, american in verify._SPELLINGS.items()}
_MIXUPS = {
    "than": "then",
    "then": "than",
    "your": "you're",
    "its": "it's",
    "it's": "its",
    "their": "there",
    "there": "their",
    "lose": "loose",
    "affect": "effect",
    "quite": "quiet",
    "advice": "advise",
}
# And the look-alikes the rules read as one word (decide/verify.py's _CONFUSED).
for _pair in verify._CONFUSED:
    _x, _y = sorted(_pair)
    _MIXUPS.setdefault(_x, _y)
    _MIXUPS.setdefault(_y, _x)
# Never a word the rules compare: "their" / "there" would take an owner away.
_MIXUPS = {x: y for x, y in _MIXUPS.items() if x not in verify._LISTED and y not in verify._LISTED}
# Plain words and a word that means the same in a question about them.
_SYNONYMS = {
    "fix": "repair",
    "repair": "fix",
    "quickly": "fast",
    "fast": "quickly",
    "big": "large",
    "large": "big",
    "small": "little",
    "need": "require",
    "choose": "pick",
    "pick": "choose",
    "select": "choose",
    "use": "utilise",
    "change": "modify",
    "modify": "change",
    "find": "locate",
    "locate": "find",
    "car": "vehicle",
    "help": "assist",
    "buy": "purchase",
    "purchase": "buy",
    "begin": "start",
    "start": "begin",
    "show": "display",
    "cheap": "inexpensive",
    "easy": "simple",
    "simple": "easy",
    "often": "frequently",
    "usually": "typically",
    "typically": "usually",
    "problem": "issue",
    "issue": "problem",
    "error": "mistake",
    "mistake": "error",
    "explain": "describe",
    "describe": "explain",
    "correct": "right",
    "enough": "sufficient",
    "important": "essential",
    "example": "instance",
    "job": "task",
    "get": "obtain",
}
_GREETINGS = ("Hi, ", "Hello! ", "Hey, ", "Quick question: ", "Hi there. ", "Please help: ")
_THANKS = (" Thanks!", " Thank you.", " Thanks in advance.", " Any help appreciated.", " Cheers.")
_HOW = re.compile(
    r"^(?:how (?:do|can|should|would) i|what(?:'s| is) the best way to|"
    r"what(?:'s| is) the way to|how to) (?P<rest>[^?]+)\?*$",
    re.IGNORECASE,
)
_TELL = re.compile(
    r"^(?:tell me|explain|show me|describe) how to (?P<rest>[^.?!]+)[.!]*$", re.IGNORECASE
)
_WHAT_IS = re.compile(r"^what (?:is|are) (?P<rest>[^?]+)\?*$", re.IGNORECASE)
_ASKING = re.compile(r"^(?:can|could|would) you (?:please )?(?P<rest>[^?]+)\?*$", re.IGNORECASE)
_ACRONYM = re.compile(r"[A-Z]{2,}s?")
_SENTENCE_BREAK = re.compile(r"(?<=[.?!])\s+")  # not inside "3.12" or "e.g."


def _changeable(text: str) -> list[re.Match[str]]:
    """Words a slip may touch: four letters or more, not capitalised (a name, or the
    first word, which a reader would notice) and not a word the rules compare."""
    # Nor words of a hedge ("not sure"): misspelt, the rules would count its "not".
    hedges = [h.span() for h in verify._HEDGES.finditer(text.lower())]
    return [
        m
        for m in _WORD.finditer(text)
        if not any(start <= m.start() < end for start, end in hedges)
        and len(m.group(0)) >= 4
        and m.group(0).islower()
        and "'" not in m.group(0)
        and m.group(0) not in _PROTECTED
    ]


def slip(word: str, rng: random.Random) -> str:
    """One slip of the fingers, past the first letter."""
    i = rng.randrange(1, len(word))
    kind = rng.randrange(4)
    if kind == 0 and i < len(word) - 1 and word[i] != word[i + 1]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]  # swapped
    if kind == 1:
        return word[:i] + word[i + 1 :]  # dropped
    if kind == 2:
        return word[:i] + word[i] + word[i:]  # doubled
    near = sorted(verify._KEYS.get(word[i], frozenset()))
    if near:
        return word[:i] + rng.choice(near) + word[i + 1 :]  # a neighbouring key
    return word[:i] + word[i + 1 :]


def vowel_slip(word: str, rng: random.Random) -> str:
    """One vowel past the first letter written as another ("visible" -> "visable")."""
    at = [i for i, c in enumerate(word) if i > 0 and c in _VOWELS]
    if not at:
        return word
    i = rng.choice(at)
    return word[:i] + rng.choice(sorted(_VOWELS - {word[i]})) + word[i + 1 :]


def typo(text: str, rng: random.Random) -> str:
    """The same question misspelt: one to three changes of the kinds above, or of the
    ways people write fast: a vowel for another, a real word for its look-alike
    ("capitol"), an article or "is" left out, "whats" for "what is", digits for a
    number word, two words run together ("everyday")."""
    out = text
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        kind = rng.random()
        if kind < 0.5:
            words = _changeable(out)
            if words:
                m = rng.choice(words)
                word = m.group(0)
                slipped = slip(word, rng) if rng.random() < 0.75 else vowel_slip(word, rng)
                if slipped not in _PROTECTED:  # "main" -> "min" is a unit, not a typo
                    out = out[: m.start()] + slipped + out[m.end() :]
                continue
        if kind < 0.6:
            out = _lower(out).rstrip(" ?.!")
        elif kind < 0.67:
            out = _IN_WORD_APOSTROPHE.sub("", out)  # "don't" -> "dont"; quotes stay
        elif kind < 0.74:
            out = _swap_words(out, _AMERICAN if rng.random() < 0.5 else verify._SPELLINGS, rng)
        elif kind < 0.81:
            out = _swap_words(out, _MIXUPS, rng)
        elif kind < 0.86:
            out = _drop_small_word(out, rng)
        elif kind < 0.91:
            out = _swap_phrases(out, _CONTRACTED, rng)
        elif kind < 0.96:
            out = _as_digits(out, rng)
        else:
            out = _run_together(out, rng)
    return out


# Informal contractions: "what is" -> "whats", "I am" -> "im", "do not" -> "dont".
_CONTRACTED = {
    " ".join(full): short
    for short, full in verify._BARE_CONTRACTIONS.items()
    if short not in ("cannot",)
}
_AS_DIGITS = {w: d for w, d in verify._DIGITS.items() if 2 <= int(d) <= 20}
_IN_WORD_APOSTROPHE = re.compile(r"(?<=[A-Za-z])['\u2019](?=[A-Za-z])")
_NUMBER_NEAR = re.compile(r"(?:\d|\b(?:" + "|".join(verify._NUMBERS_WRITTEN) + r"))\W*$", re.I)
_NUMBER_AFTER = re.compile(r"(?:\d|(?:" + "|".join(verify._NUMBERS_WRITTEN) + r")\b)", re.I)
_SMALL = re.compile(r"\b(?:a|an|the|is|are|of|to)\s+(?=[a-z])")


def _as_digits(text: str, rng: random.Random) -> str:
    """A number word written in digits ("two weeks" -> "2 weeks"), where it stands
    alone: not in "twenty five", "eight and one", "two hundred"."""
    words = list(_WORD.finditer(text))
    joined = frozenset(verify._NUMBERS_WRITTEN) | {"and"}
    found = [
        m
        for k, m in enumerate(words)
        if m.group(0).lower() in _AS_DIGITS
        and (k == 0 or words[k - 1].group(0).lower() not in joined)
        and (k + 1 == len(words) or words[k + 1].group(0).lower() not in joined)
        and text[m.end() : m.end() + 1] != "-"
        and text[m.start() - 1 : m.start()] != "-"
    ]
    if not found:
        return text
    m = rng.choice(found)
    return text[: m.start()] + _AS_DIGITS[m.group(0).lower()] + text[m.end() :]


def _drop_small_word(text: str, rng: random.Random) -> str:
    """An article, "is"/"are", "of" or "to" left out (not the first word, nor one
    between numbers: "two to four" is not "two four")."""
    found = [
        m
        for m in _SMALL.finditer(text)
        if m.start() > 0
        and not _NUMBER_NEAR.search(text[max(0, m.start() - 12) : m.start()])
        and not _NUMBER_AFTER.match(text[m.end() :])
    ]
    if not found:
        return text
    m = rng.choice(found)
    return text[: m.start()] + text[m.end() :]


def _swap_phrases(text: str, table: dict[str, str], rng: random.Random) -> str:
    found = [
        (m, phrase)
        for phrase in table
        for m in re.finditer(rf"\b{re.escape(phrase)}\b", text, re.IGNORECASE)
    ]
    if not found:
        return text
    m, phrase = rng.choice(sorted(found, key=lambda f: (f[0].start(), f[1])))
    return text[: m.start()] + table[phrase] + text[m.end() :]


def _run_together(text: str, rng: random.Random) -> str:
    """Two neighbouring words written as one where that is a word ("every day")."""
    dictionary = verify._dictionary() or frozenset()
    found = [
        m
        for m in re.finditer(r"\b([a-z]+) ([a-z]+)\b", text)
        if (m.group(1) + m.group(2)) in dictionary
        and m.group(1) not in _PROTECTED
        and m.group(2) not in _PROTECTED
    ]
    if not found:
        return text
    m = rng.choice(found)
    return text[: m.start()] + m.group(1) + m.group(2) + text[m.end() :]


def _lower(text: str) -> str:
    """Lower case, but for acronyms ("US", "GPG"): the rules read "us" as a pronoun."""
    return _WORD.sub(
        lambda m: m.group(0) if _ACRONYM.fullmatch(m.group(0)) else m.group(0).lower(), text
    )


def _swap_words(text: str, table: dict[str, str], rng: random.Random) -> str:
    found = [
        m
        for m in _WORD.finditer(text)
        if m.group(0).lower() in table and (m.start() == 0 or not m.group(0)[:1].isupper())
    ]
    if not found:
        return text
    m = rng.choice(found)
    word = table[m.group(0).lower()]
    if m.group(0)[:1].isupper():
        word = word[:1].upper() + word[1:]
    return text[: m.start()] + word + text[m.end() :]


def reword(text: str, rng: random.Random) -> str:
    """The same question put another way (its structure, a greeting, a synonym)."""
    sentences = [s for s in _SENTENCE_BREAK.split(text.strip()) if s]
    if not sentences:
        return text
    *context, last = sentences
    ways = [_as_request(last, rng), _as_question(last)]
    options = [w for w in ways if w is not None and w != last]
    choice = rng.random()
    if options and choice < 0.45:
        return " ".join([*context, rng.choice(options)])
    if context and last.endswith("?") and choice < 0.6:
        return " ".join([last, *context])  # the question first, then its context
    if choice < 0.8:
        synonym = _swap_words(text, _SYNONYMS, rng)
        if synonym != text:
            return synonym
    if rng.random() < 0.5:
        return rng.choice(_GREETINGS) + text[:1].lower() + text[1:]
    return text.rstrip() + rng.choice(_THANKS)


def _as_request(question: str, rng: random.Random) -> str | None:
    m = _HOW.match(question)
    if m:
        lead = rng.choice(("Tell me how to", "Explain how to", "Show me how to", "How to"))
        return f"{lead} {m.group('rest')}."
    m = _WHAT_IS.match(question)
    if m and "?" not in m.group("rest"):
        verb = "are" if question.lower().startswith("what are") else "is"
        return rng.choice((f"Explain what {m.group('rest')} {verb}.", f"Define {m.group('rest')}."))
    m = _ASKING.match(question)
    if m:
        return f"Please {m.group('rest')}."
    return None


def _as_question(request: str) -> str | None:
    m = _TELL.match(request)
    if m:
        return f"How do I {m.group('rest')}?"
    return None


def augmented(pairs: Sequence[Pair], rng: random.Random, near_repeats: float = 0.15) -> list[Pair]:
    """For each pair, one variant of one of its sides, labelled as the pair (a typo
    or a rewording changes no answer, and leaves a trap's difference where it was);
    and for a share of the texts, the text against a variant of itself (served)."""
    out: list[Pair] = []
    for p in pairs:
        a, b = (p["a"], p["b"]) if rng.random() < 0.5 else (p["b"], p["a"])
        variant = typo(b, rng) if rng.random() < 0.5 else reword(b, rng)
        if not verify.same_words(variant, b) and not verify.same_words(variant, a):
            out.append({"a": a, "b": variant, "same_answer": bool(p["same_answer"])})
        if rng.random() < near_repeats:
            changed = typo(a, rng) if rng.random() < 0.6 else reword(typo(a, rng), rng)
            if changed != a:
                out.append({"a": a, "b": changed, "same_answer": True})
    return out
