"""Prefix-cache secrets and the salts derived from them (plain Python: the models store the
secrets, the gateway sends the salts)."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_cache_secret() -> str:
    """A random secret from which a tenant's (or a sharing group's) prefix-cache salt is derived."""
    return secrets.token_hex(32)


def prefix_cache_salt(secret: str, client_salt: str | None = None) -> str:
    """The `cache_salt` the gateway sends to engines for requests keyed by `secret`.

    vLLM only reuses prefix-cache blocks between requests with equal salts, so a salt nobody
    else can produce keeps a tenant's cached prefixes (and what their timing reveals) its own.
    A client's own salt is mixed in, never used alone: any salt a client picks maps into its
    tenant's (or group's) space, which no other tenant can reach without the secret. The two
    messages differ in their first byte, so no client salt yields the plain salt.
    """
    message = b"t" if client_salt is None else b"c" + client_salt.encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
