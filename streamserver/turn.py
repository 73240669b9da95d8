"""Short-lived TURN credentials in coturn's REST-API scheme (`use-auth-secret`).

The gateway and the TURN server share one secret and nothing else: the gateway mints, for each
holder of a valid room token, a username `<expiry unix time>:<student id or random>` and the
credential base64(HMAC-SHA1(secret, username)); coturn (`--use-auth-secret
--static-auth-secret=...`) recomputes the credential from the username and refuses it once the
time in it has passed. A credential copied out of a page therefore stops working by itself, and
no TURN user list is kept anywhere.

The secret comes from the environment (STREAMSERVER_TURN_SECRET) or a file
(STREAMSERVER_TURN_SECRET_FILE: a mounted container secret), never a flag: a flag is visible in
`ps` to every user of the machine.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Mapping


class TurnSecretError(ValueError):
    """The TURN secret's variables do not give one secret."""


def secret_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """STREAMSERVER_TURN_SECRET, or the contents of the file STREAMSERVER_TURN_SECRET_FILE names
    (its trailing newline dropped); None when neither is set."""
    environ = os.environ if environ is None else environ
    given, path = environ.get("STREAMSERVER_TURN_SECRET"), environ.get("STREAMSERVER_TURN_SECRET_FILE")
    if given and path:
        raise TurnSecretError("set STREAMSERVER_TURN_SECRET or STREAMSERVER_TURN_SECRET_FILE, not both")
    if path:
        try:
            given = open(path, encoding="utf-8").read().strip()
        except OSError as error:
            raise TurnSecretError(f"STREAMSERVER_TURN_SECRET_FILE {path}: {error.strerror or error}") from None
        if not given:
            raise TurnSecretError(f"STREAMSERVER_TURN_SECRET_FILE {path} is empty")
    return given or None


def credential(secret: str, username: str) -> str:
    """What coturn expects as the password of `username` under `--static-auth-secret=secret`."""
    return base64.b64encode(hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()).decode()


def mint(secret: str, urls: list[str], ttl_s: float, student_id: str | None = None, now: float | None = None) -> dict:
    """An RTCIceServer for `urls` whose credential expires `ttl_s` from now. The username names
    the student where the token does (coturn logs it with each allocation), else a random label:
    a shared link's student gets its id only with the offer, after the page asked for this."""
    expiry = int((time.time() if now is None else now) + ttl_s)
    # coturn reads the expiry as the digits before the first ':'; what follows is free text
    username = f"{expiry}:{student_id or secrets.token_hex(8)}"
    return {"urls": list(urls), "username": username, "credential": credential(secret, username)}
