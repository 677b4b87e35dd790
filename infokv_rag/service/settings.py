"""Service settings: defaults, environment variables, and the refusal to start unprotected."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..config import DEFAULT_METHOD, CompressionConfig, parse_keep
from ..errors import ConfigError
from ..generation import DEFAULT_MAX_NEW_TOKENS
from ..pdf_limits import CONTENT_LIMIT
from ..placement import dtype_name
from .tenants import KeyRing, read_keys_file, split_entries

ENV_PREFIX = "INFOKV_"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def default_data_dir() -> Path:
    from ..models import cache_root

    return cache_root() / "service"


@dataclass(frozen=True)
class Settings:
    """Everything the service can be configured with; `from_env` reads `INFOKV_<FIELD>` variables.

    Authentication: requests to /v1 need one of the configured keys (Bearer token or X-API-Key header):
    `api_keys` and `admin_keys` are entries `tenant:key` or bare keys (see `tenants`), `keys_file` a file of
    them. With no keys the service refuses to start unless `allow_anonymous` is set explicitly.
    """

    model: str = "default"
    """default, tiny, a local HF directory, a .gguf file or a Hugging Face hub id (org/name[@revision])."""
    data_dir: Path = field(default_factory=default_data_dir)
    store: str | None = None
    """A cache store shared by several service processes (Ray Serve replicas): s3://bucket/prefix,
    file:///shared/dir or any fsspec URL (extra [scale]), or a shared local path. Documents, their owners and
    caches then live there, and `data_dir` only stages uploads. None: everything under `data_dir`."""
    lease_seconds: int = 30
    """With a store: a document whose reader has not renewed its lease for this long is read by another process."""
    device: str | None = None
    """auto (None: CUDA when available, else CPU), cpu, cuda, cuda:N or mps."""
    dtype: str | None = None
    """auto (None: bfloat16 on CUDA, float16 where unsupported; float32 elsewhere), bf16, fp16 or fp32."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # a logged or displayed Settings shows no key
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    """Keys whose callers see every tenant's documents, and those persisted before tenants existed."""
    keys_file: Path | None = None
    allow_anonymous: bool = False
    share_caches: bool = False
    """Serve an upload from an identical ready upload's cache (same file and options: the count `1` is not the
    ratio `1.0`), whichever tenant made it. Off by default: sharing saves a prefill but tells a tenant, by its
    speed and its info (`prefill_seconds` 0), that someone else uploaded the same file."""
    # Limits
    max_upload_bytes: int = 32 * 1024 * 1024
    max_document_chars: int = 2_000_000
    """Characters of extracted text, checked before any tokenization (the token limit is the context window)."""
    max_pages: int = 1000
    max_pdf_content_bytes: int = CONTENT_LIMIT
    """Decoded page content a PDF's text extraction may parse (`load_document`'s `content_limit`)."""
    max_question_chars: int = 4000
    max_new_tokens: int = 1024
    """The largest max_tokens a request may ask for."""
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_request_bytes: int = 1024 * 1024
    """Body limit of every request but uploads (JSON questions and chats)."""
    upload_idle_seconds: int = 30
    """An upload whose body sends nothing for this long is refused (408 `upload_timeout`), giving back its queue
    place: a client that stalls mid-upload would hold it for as long as it kept its connection open."""
    max_documents_per_tenant: int = 1000
    """Documents one tenant may keep (every status, counting uploads being received): one more is refused (507
    `document_quota_exceeded`) before it is received, so that one tenant cannot fill the disk for every other."""
    max_upload_seconds: int = 600
    """An upload whose body takes longer than this to arrive is refused (408 `upload_timeout`), giving back its
    queue place: a client sending a byte within every idle interval would hold it indefinitely. 600 s is 32 MiB at
    56 KB/s."""
    # Scheduling
    max_active_generations: int = 8
    """Answers decoded in round-robin at once; later ones wait in FIFO order."""
    max_queued_generations: int = 64
    max_queued_uploads: int = 16
    max_generations_per_tenant: int | None = None
    """Answers one tenant may have in flight at once, decoding or queued (beyond it: 429 `tenant_queue_full`),
    so that one tenant cannot take every place of the server's and starve the others. None: half of what the
    server holds (`max_active_generations + max_queued_generations`, rounded up: 36 by default), which always
    leaves the other tenants at least the other half, and lets a single tenant still use about half of a queue
    that is rarely full. At most the server's own total (refused above it: a share larger than the server can
    hold would never apply, and a setting that does nothing is a mistake to report, not to round away); equal
    to it turns the share off."""
    max_queued_uploads_per_tenant: int | None = None
    """Uploads of one tenant waiting to be read at once, queued or being saved (beyond it: 429
    `tenant_queue_full`). None: half of `max_queued_uploads`, rounded up (8 by default), for the same reasons as
    `max_generations_per_tenant`. At most `max_queued_uploads` (refused above it); equal to it turns the share
    off. Documents read again after a restart or a takeover count toward it but are never refused."""
    ingest_chunk_size: int = 256
    """Prefill chunk of uploads: an answer waits at most about one chunk's forward pass at a time."""
    loaded_documents: int = 8
    """Compressed caches kept in memory (least recently used are dropped; they reload from disk)."""
    warmup: bool = True
    """Run one tiny prefill and decoding step at startup, so the first real request is not slowed down."""
    # Defaults of uploads
    default_method: str = DEFAULT_METHOD
    default_keep: float | int = 0.25

    keyring: KeyRing = field(init=False, repr=False, compare=False)
    """Every credential of `api_keys`, `admin_keys` and `keys_file`, validated."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("api_keys", "admin_keys"):
            object.__setattr__(self, name, tuple(k.strip() for k in getattr(self, name) if k and k.strip()))
        keys, admins = list(self.api_keys), list(self.admin_keys)
        if self.keys_file is not None:
            object.__setattr__(self, "keys_file", Path(self.keys_file).expanduser())
            from_file, admins_from_file = read_keys_file(self.keys_file)
            keys += from_file
            admins += admins_from_file
        object.__setattr__(self, "keyring", KeyRing.from_entries(keys, admins))
        for name in (*_INT_FIELDS, *_OPTIONAL_INT_FIELDS):  # every count is positive
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be positive, got {value}")
        for share, held, what in (
            ("max_generations_per_tenant", self.generations_held, "max_active_generations + max_queued_generations"),
            ("max_queued_uploads_per_tenant", self.max_queued_uploads, "max_queued_uploads"),
        ):
            value = getattr(self, share)
            if value is not None and value > held:
                raise ConfigError(
                    f"{share} is {value}, more than the {held} the whole server holds ({what}): a "
                    f"tenant's share must not exceed it (set it to {held} to give every tenant the whole queue)"
                )
        if self.store is not None and self.share_caches:
            raise ConfigError("share_caches is not available with a shared store (INFOKV_STORE)")
        if self.default_max_tokens > self.max_new_tokens:
            raise ConfigError("default_max_tokens must not exceed max_new_tokens")
        try:  # at start, not as every upload's 422 (nor as a document read again after a restart, failed for good)
            CompressionConfig(method=self.default_method, keep=self.default_keep, chunk_size=self.ingest_chunk_size)
        except ConfigError as exc:
            raise ConfigError(
                f"default_method {self.default_method!r}, default_keep {self.default_keep} and ingest_chunk_size "
                f"{self.ingest_chunk_size} make no compression an upload can use: {exc}"
            ) from exc

    @property
    def generations_held(self) -> int:
        """Answers the server holds at once, decoding or queued; one more is refused with 503 `busy`."""
        return self.max_active_generations + self.max_queued_generations

    @property
    def generation_share(self) -> int:
        """Answers one tenant may have in flight (`max_generations_per_tenant`, resolved)."""
        return _share(self.max_generations_per_tenant, self.generations_held)

    @property
    def upload_share(self) -> int:
        """Uploads of one tenant that may wait to be read (`max_queued_uploads_per_tenant`, resolved)."""
        return _share(self.max_queued_uploads_per_tenant, self.max_queued_uploads)

    @property
    def auth_required(self) -> bool:
        return bool(self.keyring)

    def check_startable(self) -> None:
        """Refuses an unprotected service unless anonymous access was asked for explicitly."""
        if not self.keyring and not self.allow_anonymous:
            raise ConfigError(
                "refusing to start without API keys: set INFOKV_API_KEYS=tenantA:key1,tenantB:key2 or "
                "INFOKV_KEYS_FILE (clients send "
                "'Authorization: Bearer <key>' or 'X-API-Key: <key>'), or set INFOKV_ALLOW_ANONYMOUS=1 "
                "to run an open service on a trusted network"
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then `INFOKV_*` environment variables, then `overrides` that are not None. A variable set to
        nothing (`INFOKV_DATA_DIR=`, as a compose file leaves one) is unset: an empty path would be the directory the
        server happens to start in."""
        environ = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if not f.init:
                continue
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None or not raw.strip():
                continue
            values[f.name] = _parse(f.name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)


_INT_FIELDS = (
    "max_upload_bytes",
    "max_document_chars",
    "max_pages",
    "max_pdf_content_bytes",
    "max_question_chars",
    "max_new_tokens",
    "default_max_tokens",
    "max_request_bytes",
    "upload_idle_seconds",
    "max_upload_seconds",
    "max_documents_per_tenant",
    "max_active_generations",
    "max_queued_generations",
    "max_queued_uploads",
    "ingest_chunk_size",
    "loaded_documents",
    "lease_seconds",
)
_OPTIONAL_INT_FIELDS = ("max_generations_per_tenant", "max_queued_uploads_per_tenant")
"""Counts that may be left unset (None; an empty variable): each then follows the setting it is a share of."""


def _share(configured: int | None, whole: int) -> int:
    """A tenant's share of a queue that holds `whole`: as configured, else half of it rounded up (so that a
    queue of one place still takes one)."""
    return configured if configured is not None else (whole + 1) // 2


def _parse(name: str, raw: str) -> Any:
    variable = ENV_PREFIX + name.upper()
    if name in ("api_keys", "admin_keys"):
        return tuple(split_entries(raw))
    if name == "keys_file":
        return Path(raw) if raw.strip() else None
    if name in ("allow_anonymous", "warmup", "share_caches"):
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ConfigError(f"{variable} must be 1/true/yes or 0/false/no, got {raw!r}")
    if name in _OPTIONAL_INT_FIELDS and not raw.strip():
        return None
    if name in _INT_FIELDS or name in _OPTIONAL_INT_FIELDS:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{variable} must be an integer, got {raw!r}") from None
    if name == "default_keep":
        return parse_keep(raw, variable)
    return raw or None if name in ("device", "dtype", "store") else raw
