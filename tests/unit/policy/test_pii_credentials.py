"""Credentials as `key=value` and in URLs: the `SECRET` type's password forms (issue #41).

Pure unit tests (no processes, no network): what is masked (the value, never the key),
what is left alone (prose, types, templates, code), that a URL's `user:password@` wins
over the e-mail detector, and that `mask_upstream` puts every value back. The property
tests generate key names and values and check that no raw value survives.
"""

from __future__ import annotations

import json
import string
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.policy.pii import PiiMasker, contains_pii

MASKER = PiiMasker()


def mask(text: str) -> str:
    return MASKER.mask(text)


# --------------------------------------------------------------------------- positives

MASKED: list[tuple[str, str]] = [
    # (text, masked text): the value goes, the key stays.
    ("password=Hunter2Hunter2!", "password=<SECRET_1>"),
    ("secret=abc123def456", "secret=<SECRET_1>"),
    ("login with password=Hunter2Hunter2! today", "login with password=<SECRET_1> today"),
    ("DB_PASSWORD=changeme", "DB_PASSWORD=<SECRET_1>"),
    ("PGPASSWORD=secretpw psql -h db", "PGPASSWORD=<SECRET_1> psql -h db"),
    ("export API_TOKEN=tok3nValue", "export API_TOKEN=<SECRET_1>"),
    ("passwd: Tr0ub4dor&3", "passwd: <SECRET_1>"),
    ("pwd=abcd1234", "pwd=<SECRET_1>"),
    ("pass=1234", "pass=<SECRET_1>"),
    ("Password: Hunter2Hunter2!", "Password: <SECRET_1>"),
    ("my password: hunter2.", "my password: <SECRET_1>."),
    ("the token: 123456", "the token: <SECRET_1>"),
    ('{"password": "hunter2x", "user": "bob"}', '{"password": "<SECRET_1>", "user": "bob"}'),
    ('{"password":"a b c d"}', '{"password":"<SECRET_1>"}'),
    ("{'client_secret': 'abcd1234'}", "{'client_secret': '<SECRET_1>'}"),
    ('access_token: "ya29.a0AfH6SMB"', 'access_token: "<SECRET_1>"'),
    ("refresh_token=1//0gLx9Yz", "refresh_token=<SECRET_1>"),
    ("api_key=abcdefgh", "api_key=<SECRET_1>"),
    ("apikey := 'k3y-value'", "apikey := '<SECRET_1>'"),
    ("X-Api-Key: abc123def456ghi", "X-Api-Key: <SECRET_1>"),
    ("x-api-key: abcdefghijklmnop", "x-api-key: <SECRET_1>"),
    ("API key: abc123def456", "API key: <SECRET_1>"),
    ("private_key = 'p-r-i-v-8'", "private_key = '<SECRET_1>'"),
    ("auth=Zm9vOmJhcg", "auth=<SECRET_1>"),
    ("clientSecret=abcd1234efgh", "clientSecret=<SECRET_1>"),
    ("userPass=abcd1234", "userPass=<SECRET_1>"),
    ("'password' => 's3cr3t'", "'password' => '<SECRET_1>'"),
    ("secret_key = `dj-insecure-9x`", "secret_key = `<SECRET_1>`"),
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG", "AWS_SECRET_ACCESS_KEY=<SECRET_1>"),
    ("passphrase: c0rrect-horse", "passphrase: <SECRET_1>"),
    # JSON inside a JSON string (tool-call arguments quoting a config).
    (
        '{"cfg": "{\\"password\\": \\"s3cr3t!x\\"}"}',
        '{"cfg": "{\\"password\\": \\"<SECRET_1>\\"}"}',
    ),
    # Connection and query strings: the value ends where the next key begins.
    (
        "Server=db;User Id=u;Password=p@ss;word;Trusted_Connection=True",
        "Server=db;User Id=u;Password=<SECRET_1>;Trusted_Connection=True",
    ),
    ("https://h/cb?token=abc123&state=xyz", "https://h/cb?token=<SECRET_1>&state=xyz"),
    ("password=tr0ub4dor&3 ok", "password=<SECRET_1> ok"),
    # Sentence punctuation and an unbalanced bracket after a value are not part of it.
    ("connect(password=abc123)", "connect(password=<SECRET_1>)"),
    ("Set secret=abc123def456.", "Set secret=<SECRET_1>."),
    # The whole value is one secret, even where it holds something another type would take.
    ("password=jane@example.com!", "password=<SECRET_1>"),
]


@pytest.mark.parametrize(("text", "expected"), MASKED)
def test_credential_values_are_masked_and_keys_kept(text: str, expected: str) -> None:
    session = MASKER.session()
    assert session.mask(text) == expected
    assert session.found == {"SECRET": expected.count("<SECRET_")}
    assert session.restore(expected) == text


URLS: list[tuple[str, str]] = [
    ("https://bob:s3cretPass@db.internal", "https://<SECRET_1>@db.internal"),
    ("postgres://bob:s3cret@db.internal:5432/app", "postgres://<SECRET_1>@db.internal:5432/app"),
    ("redis://:hunter2pw@cache:6379/0", "redis://<SECRET_1>@cache:6379/0"),
    # A raw '@' inside the password: the authority ends at the last one.
    ("mysql+pymysql://app:p@ss@db/x", "mysql+pymysql://<SECRET_1>@db/x"),
    ("clone https://oauth2:glpat-abc123@gitlab.example.com/g/r.git", "clone https://<SECRET_1>@gitlab.example.com/g/r.git"),
    ("DATABASE_URL=postgresql://u:pw12@h/db", "DATABASE_URL=postgresql://<SECRET_1>@h/db"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), URLS)
def test_url_userinfo_is_masked_whole_before_the_email_detector(text: str, expected: str) -> None:
    session = MASKER.session()
    assert session.mask(text) == expected
    assert session.found == {"SECRET": 1}  # not an EMAIL, and the user name is gone too
    assert session.restore(expected) == text


# --------------------------------------------------------------------------- negatives

LEFT_ALONE = [
    # Prose.
    "the password is required",
    "token count: 12",
    "Password: required.",
    "Password: Required",
    "Passwords: must be 8+ characters",
    "Password: must be long",
    "Secret: Tuesday.",
    "Token: 1024 max",
    "Auth: Basic",
    "password: (optional)",
    "password: see https://example.com/reset",
    "The password-protected file: report.pdf",
    "author: Jane Austen",
    "tokenizer: gpt2, max_tokens: 256, Tokens: 50000",
    "bypass=true and compass: 30deg",
    # Types, switches, templates, redactions.
    '{"password": "string", "token": "<your token>"}',
    '{"password": {"type": "string"}}',
    "password=${DB_PASSWORD} token=$API_TOKEN secret={{ vault.secret }}",
    "password=%s and password=%(pw)s and api_key={api_key}",
    "password: ******** and token=xxxxxxxx",
    "auth=none, secret=null, token=true",
    "password=<SECRET_1>",
    # Code: calls, indexing, attributes, variables passed on.
    "password = getpass.getpass()",
    "f(password=getpass())",
    'secret = os.environ["SECRET"]',
    "token=args.token, api_key=settings.API_KEY",
    "self.password = password",
    "login(password=new_password)",
    "if password == 'x'",
    # The shell's working directory.
    "PWD=/home/bob OLDPWD=/tmp",
    "pwd: /srv/app",
    # URLs without a password.
    "see https://example.com:8443/x and ssh://host:22",
]


@pytest.mark.parametrize("text", LEFT_ALONE)
def test_prose_types_templates_and_code_are_left_alone(text: str) -> None:
    assert mask(text) == text
    assert not contains_pii(text)


def test_block_mode_sees_a_password() -> None:
    assert contains_pii("password=Hunter2Hunter2!")
    assert contains_pii("https://bob:s3cretPass@db.internal")
    assert not contains_pii("the password is required")


def test_credentials_and_userinfo_are_the_secret_type() -> None:
    text = "password=Hunter2Hunter2! at https://bob:pw@db.internal"
    secrets_only = "password=<SECRET_1> at https://<SECRET_2>@db.internal"
    assert PiiMasker(kinds=["SECRET"]).mask(text) == secrets_only
    # Without SECRET, no credential is taken, and the userinfo reads as a partial e-mail.
    emails_only = "password=Hunter2Hunter2! at https://bob:<EMAIL_1>"
    assert PiiMasker(kinds=["EMAIL"]).mask(text) == emails_only


# --------------------------------------------------------------------------- mask_upstream


def test_tool_call_arguments_stay_json_and_restore() -> None:
    args = json.dumps({"dsn": "postgres://bob:s3cret@db/app", "password": "Hunter2Hunter2!"})
    messages = [
        {"role": "user", "content": "connect with password=Hunter2Hunter2!"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "db", "arguments": args}}
            ],
        },
    ]
    session = MASKER.session()
    masked = session.mask_messages(messages)
    assert masked[0]["content"] == "connect with password=<SECRET_1>"
    sent = masked[1]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(sent) == {"dsn": "postgres://<SECRET_2>@db/app", "password": "<SECRET_1>"}
    assert "Hunter2" not in sent and "s3cret" not in sent
    assert session.restore(sent) == args


def test_stream_restore_puts_credentials_back_at_every_split() -> None:
    session = MASKER.session()
    original = "use password=Hunter2Hunter2! on https://bob:s3cretPass@db.internal"
    reply = session.mask(original)
    assert reply == "use password=<SECRET_1> on https://<SECRET_2>@db.internal"
    for cut in range(len(reply) + 1):
        restorer = session.restore_stream()
        out = restorer.feed(reply[:cut]) + restorer.feed(reply[cut:]) + restorer.flush()
        assert out == original, cut


# --------------------------------------------------------------------------- properties

WORDS = [
    "password", "passwd", "pwd", "pass", "passphrase", "secret", "token", "access_token",
    "refresh_token", "api_key", "apikey", "api-key", "client_secret", "private_key",
    "secret_key", "auth",
]  # fmt: skip
PREFIXES = ["", "DB_", "POSTGRES_", "x-", "my.", "--", "app_"]
# Unquoted values: no whitespace, quotes, brackets or `;&,` (which may start another key),
# and no '$', '%' or '<' (templates). Quoted values may hold anything but their quote.
VALUE_CHARS = string.ascii_letters + string.digits + "!@#^*+=~_-/:"
QUOTED_CHARS = VALUE_CHARS + " ;&,()[]{}<>$%"


def _shaped(alphabet: str) -> st.SearchStrategy[str]:
    """8-40 characters with a lowercase letter and a digit (a password, not a word)."""
    body = st.text(alphabet=alphabet, min_size=6, max_size=38)
    return st.builds(
        lambda low, digit, rest: low + rest + digit,
        st.sampled_from(string.ascii_lowercase),
        st.sampled_from(string.digits),
        body,
    ).filter(lambda v: "://" not in v)


FORMS_UNQUOTED = ["{k}={v}", "{k}: {v}", "{k} = {v}", "{k}:={v}"]
FORMS_QUOTED = ['"{k}": "{v}"', "{k}='{v}'", "'{k}' => '{v}'", '{k} = "{v}"', "{k}: `{v}`"]


@st.composite
def keys(draw: st.DrawFn) -> str:
    word = draw(st.sampled_from(WORDS))
    word = draw(st.sampled_from([word, word.upper(), word.capitalize()]))
    return draw(st.sampled_from(PREFIXES)) + word


@settings(max_examples=300, deadline=None)
@given(
    key=keys(),
    unquoted=st.tuples(st.sampled_from(FORMS_UNQUOTED), _shaped(VALUE_CHARS)),
    quoted=st.tuples(st.sampled_from(FORMS_QUOTED), _shaped(QUOTED_CHARS)),
    use_quoted=st.booleans(),
    before=st.sampled_from(["", "Config: ", "then\n", "please use "]),
)
def test_generated_credentials_never_survive_and_restore(
    key: str,
    unquoted: tuple[str, str],
    quoted: tuple[str, str],
    use_quoted: bool,
    before: str,
) -> None:
    form, value = quoted if use_quoted else unquoted
    text = before + form.format(k=key, v=value) + " and more text"
    session = MASKER.session()
    masked = session.mask(text)
    assert value not in masked
    assert key in masked  # the key stays readable
    assert session.restore(masked) == text


@settings(max_examples=200, deadline=None)
@given(
    scheme=st.sampled_from(["https", "http", "postgres", "postgresql+psycopg", "redis", "amqp"]),
    user=st.text(alphabet=string.ascii_letters + "._-", min_size=0, max_size=12),
    password=_shaped(string.ascii_letters + string.digits + "!$&*+,;=~_-@:"),
    host=st.sampled_from(["db.internal", "example.com", "10.0.0.5:5432", "cache"]),
    path=st.sampled_from(["", "/", "/app?ssl=1", "#x"]),
)
def test_generated_url_userinfo_never_survives_and_restores(
    scheme: str, user: str, password: str, host: str, path: str
) -> None:
    text = f"connect to {scheme}://{user}:{password}@{host}{path} now"
    session = MASKER.session()
    masked = session.mask(text)
    assert password not in masked
    assert masked.startswith(f"connect to {scheme}://<SECRET_1>@")
    assert session.restore(masked) == text


# --------------------------------------------------------------------------- cost

ADVERSARIAL = [
    "password=" * 11_000,
    "PASSWORD: " * 10_000,
    "pass" * 25_000,
    "://a:" * 20_000,
    "x://" + "a:" * 50_000,
    "x://a:" + "b" * 100_000,
    '"password": "' * 7_000,
    '\\"password\\": \\"' * 5_000,
    "token=a;b=" * 10_000,
    "password='" * 10_000,
    "password=" + "a" * 100_000,
    "api access tokens authentication passwords secret " * 2_000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=lambda t: repr(t[:8]))
def test_credential_patterns_stay_linear(text: str) -> None:
    # Generous bound (these take well under 0.3 s here); a quadratic pattern takes minutes.
    start = time.perf_counter()
    mask(text)
    assert time.perf_counter() - start < 2.0
