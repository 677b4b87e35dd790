"""Tenants and their API keys: who is calling, and which documents they may see.

Every API key belongs to one tenant. Keys are configured as entries `tenant:key` (several keys may share a
tenant) or as a bare `key`, which is its own tenant (named `key-` + the first 12 hex digits of the key's
sha256, so that the name is stable across restarts and never reveals the key). Admin keys are entries of
the same form whose callers see every tenant's documents, and documents without an owner (persisted
before tenants existed).

Documents are owned by the tenant that uploaded them; every other tenant is told such a document does
not exist (the same 404 as for an unknown id), so ids cannot be probed across tenants.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

MIN_KEY_CHARS = 8
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KEY_PATTERN = re.compile(r"^[\x20-\x7e]+$")
"""Printable ASCII: HTTP header values carry no other characters portably (servers read them as Latin-1, clients
send UTF-8 or refuse to send them), so a key with any other would never match as configured."""
KEY_ADVICE = "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: its tenant, and whether it may see every tenant's documents."""

    tenant: str | None
    """None for the caller of an open service (INFOKV_ALLOW_ANONYMOUS): its uploads belong to no tenant."""
    admin: bool = False

    def may_see(self, owner: str | None) -> bool:
        if self.tenant is None:
            # An open service's caller: the documents of no tenant. A directory that a service with keys wrote,
            # opened without them (its keys variable lost), must not hand every tenant's documents to anyone.
            return owner is None
        # Documents without an owner predate tenants: nobody but an admin can tell whose they are.
        return self.admin or owner == self.tenant


@dataclass(frozen=True)
class Credential:
    tenant: str
    digest: bytes
    """sha256 of the key: only digests are kept and compared (constant time, equal lengths)."""
    admin: bool = False

    @property
    def principal(self) -> Principal:
        return Principal(self.tenant, self.admin)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def bare_key_tenant(key: str) -> str:
    # From the key's digest: a key from the environment may hold undecodable bytes (surrogates), refused after.
    return "key-" + key_digest(key).hex()[:12]


def parse_entry(entry: str, *, admin: bool = False, where: str = "INFOKV_API_KEYS") -> Credential:
    """`tenant:key` or a bare `key` (its own tenant). The tenant is what precedes the first colon."""
    text = entry.strip()
    tenant, separator, key = text.partition(":")
    if not separator:
        tenant, key = "", text
    key = key.strip()
    tenant = tenant.strip() or bare_key_tenant(key)
    if not TENANT_PATTERN.fullmatch(tenant):
        # Not echoed: what precedes a colon may be part of a bare key that holds one.
        raise ConfigError(
            f"{where}: an entry's tenant name (what precedes its first ':') must be 1-64 letters, digits, '.', "
            "'_' or '-'; a key that holds ':' is written 'tenant:key'"
        )
    if len(key) < MIN_KEY_CHARS:
        # The message names the tenant, never the key.
        raise ConfigError(
            f"{where}: the API key of tenant {tenant!r} is shorter than {MIN_KEY_CHARS} characters; "
            f"API keys must be at least {MIN_KEY_CHARS} characters long; {KEY_ADVICE}"
        )
    if not KEY_PATTERN.fullmatch(key):
        raise ConfigError(
            f"{where}: the API key of tenant {tenant!r} holds a character that is not printable ASCII, which HTTP "
            f"headers do not carry portably: no client could present it; {KEY_ADVICE}"
        )
    return Credential(tenant=tenant, digest=key_digest(key), admin=admin)


def split_entries(raw: str) -> list[str]:
    """Entries of a comma- or newline-separated list (an environment variable's: a `#` is part of a key there;
    comments belong to keys files, `read_keys_file`)."""
    return [part.strip() for line in raw.splitlines() for part in line.split(",") if part.strip()]


def read_keys_file(path: Path) -> tuple[list[str], list[str]]:
    """(key entries, admin key entries) of a keys file: one `tenant:key` or `key` per line, `admin` after
    it for an admin key, `#` comments.

        tenantA:3q2-kVh1...        # tenantA's key
        tenantB:Zt9_aa0P...
        ops:Qm1x0-Lw...  admin
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the keys file {path}: {exc.strerror or exc}") from None
    keys: list[str] = []
    admins: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2 or (len(fields) == 2 and fields[1] != "admin"):
            raise ConfigError(f"{path}, line {number}: expected 'tenant:key' or 'key', optionally followed by 'admin'")
        (admins if len(fields) == 2 else keys).append(fields[0])
    return keys, admins


class KeyRing:
    """The configured credentials; `find` maps a presented key to its credential in constant time."""

    def __init__(self, credentials: Iterable[Credential]) -> None:
        self.credentials = tuple(credentials)
        seen: dict[bytes, Credential] = {}
        for credential in self.credentials:
            other = seen.get(credential.digest)
            if other is not None and other != credential:
                raise ConfigError(
                    f"the same API key is configured for tenant {other.tenant!r} and tenant "
                    f"{credential.tenant!r} (or as admin and non-admin); give each key one role"
                )
            seen[credential.digest] = credential

    @classmethod
    def from_entries(cls, keys: Iterable[str], admin_keys: Iterable[str] = ()) -> KeyRing:
        return cls(
            [
                *(parse_entry(e) for e in keys),
                *(parse_entry(e, admin=True, where="INFOKV_ADMIN_KEYS") for e in admin_keys),
            ]
        )

    def __bool__(self) -> bool:
        return bool(self.credentials)

    @property
    def tenants(self) -> set[str]:
        return {c.tenant for c in self.credentials}

    def find(self, candidate: str) -> Credential | None:
        """The credential of `candidate`; every configured key is compared, without early exit."""
        given = key_digest(candidate)
        found: Credential | None = None
        for credential in self.credentials:
            if hmac.compare_digest(given, credential.digest):
                found = credential
        return found
