"""Room tokens are decoded strictly: one spelling per token, an integer expiry, string claims,
`Authorization: Bearer` required, and nothing a client sends raises anything but TokenError."""

from __future__ import annotations

import hashlib
import hmac
import json
import string
import time
from urllib.parse import parse_qs, urlsplit

import pytest

from streamserver.rooms import tokens

SECRET = "token-test-secret"
B64URL = string.ascii_letters + string.digits + "-_"


def signed(claim: object) -> str:
    """A token whose signature is genuine, over any claim (what only a secret holder can make)."""
    body = tokens._b64(json.dumps(claim).encode())
    return f"{body}.{tokens._b64(hmac.new(SECRET.encode(), body.encode(), hashlib.sha256).digest())}"


def status(token: object, room: str | None = "r1", role: str = "student") -> int:
    try:
        tokens.verify(SECRET, token, room, role)
    except tokens.TokenError as error:
        return error.status
    return 200


def test_a_genuine_token_verifies_and_says_what_it_is_for():
    token = tokens.issue(SECRET, "r1", "student", 60)
    claim = tokens.verify(SECRET, token, "r1", "student")
    assert (claim.room_id, claim.role) == ("r1", "student") and time.time() < claim.expires <= time.time() + 61
    assert tokens.verify(SECRET, token, None, "student").room_id == "r1"
    assert status(token, room="r2") == 403 and status(token, role="teacher") == 403
    assert status(tokens.issue(SECRET, "r1", "student", -5)) == 401  # expired
    assert status(tokens.issue("another secret", "r1", "student", 60)) == 401


def test_only_the_canonical_spelling_verifies():
    token = tokens.issue(SECRET, "r1", "student", 60)
    body, sig = token.split(".")
    # The probe: padding or junk appended, and the last character's unused bits set, still
    # verified through a lenient base64 decoder.
    for variant in (token + "!!", token + "==", token + "=", body + "=." + sig, f"{body}.{sig}\n", " " + token, token + " "):
        assert status(variant) == 401, variant
    others = [f"{body}.{sig[:-1]}{c}" for c in B64URL if c != sig[-1]]
    assert len(others) == 63 and {status(t) for t in others} == {401}
    assert {status(f"{body[:-1]}{c}.{sig}") for c in B64URL if c != body[-1]} == {401}
    for malformed in ("", ".", "a.", ".a", "a.b.c", token.replace(".", ".."), "a" * 5 + "." + "b" * 5, token * 40):
        assert status(malformed) == 401, malformed


@pytest.mark.parametrize("text", ["\ud800", "é.é", "\udcff" + "a.b", "a.b\x00", "ａ.ｂ", "a.b\u202e"])
def test_non_ascii_and_surrogates_are_a_401_not_an_exception(text):
    token = tokens.issue(SECRET, "r1", "student", 60)
    assert status(text) == 401
    assert status(token[:10] + text + token[10:]) == 401


@pytest.mark.parametrize("odd", [5, None, ["a"], {"t": 1}, b"a.b", 1.5])
def test_a_token_that_is_not_a_string_is_a_401(odd):
    assert status(odd) == 401


@pytest.mark.parametrize("exp", [float("nan"), float("inf"), float("-inf"), "9999999999", True, None, 1e300,
                                 pytest.param(10**400, id="10**400"), 9_999_999_999.5, [9_999_999_999], -1])
def test_exp_must_be_a_finite_integer(exp):
    assert status(signed({"room": "r1", "role": "student", "exp": exp})) == 401
    assert status(signed({"room": "r1", "role": "student", "exp": 9_999_999_999})) == 200  # the control


@pytest.mark.parametrize("claim", [
    {"room": 1, "role": "student", "exp": 9_999_999_999},
    {"room": ["r1"], "role": "student", "exp": 9_999_999_999},
    {"room": "r1", "role": ["student"], "exp": 9_999_999_999},
    {"room": "r1", "role": None, "exp": 9_999_999_999},
    {"role": "student", "exp": 9_999_999_999},
    {"room": "r1", "exp": 9_999_999_999},
    {"room": "r1", "role": "student"},
    ["r1", "student", 9_999_999_999],
    "r1",
])
def test_room_and_role_must_be_strings(claim):
    assert status(signed(claim)) == 401


def test_a_signed_body_that_is_not_json_is_a_401():
    for raw in (b"\xff\xfe", b"[" * 100_000, b"{", b"NaN"):
        body = tokens._b64(raw)
        token = f"{body}.{tokens._b64(hmac.new(SECRET.encode(), body.encode(), hashlib.sha256).digest())}"
        assert status(token) == 401


@pytest.mark.parametrize("header,credential", [
    ("Bearer abc", b"abc"),
    ("bearer abc", b"abc"),  # the scheme is case-insensitive (RFC 7235)
    ("Bearer   abc  ", b"abc"),
    (None, None),
    ("", None),
    ("abc", None),  # the probe: a bare token was accepted
    ("Bearer", None),
    ("Bearer ", None),
    ("Basic abc", None),
    ("Bearerabc", None),
    ("Bearer é", None),
    ("Bearer \udcc3\udca9", None),  # how aiohttp hands over the bytes of a non-UTF-8 header
    ("Bearer \ud800", None),
])
def test_bearer_is_required_and_its_credential_is_bytes(header, credential):
    assert tokens.bearer(header) == credential


def test_room_links_carry_room_and_token_in_the_fragment():
    links = tokens.room_links(SECRET, "r1", "https://school.example", 60)
    assert set(links) == {"teacher_url", "student_url"}
    for role in ("teacher", "student"):
        parts = urlsplit(links[f"{role}_url"])
        assert (parts.scheme, parts.netloc, parts.path, parts.query) == ("https", "school.example", f"/{role}", "")
        fragment = parse_qs(parts.fragment)
        assert fragment["room"] == ["r1"]
        assert tokens.verify(SECRET, fragment["token"][0], "r1", role).role == role
