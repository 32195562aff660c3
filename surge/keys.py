"""API keys: a JSON file of salted key hashes, each mapped to a tenant name."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime

import msgspec
from msgspec import Struct

log = logging.getLogger("surge.keys")

_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_GENERATED = re.compile(r"sk-surge-([0-9a-f]{8})-(.+)")
_MIN_IMPORTED = 16


class _Entry(Struct, forbid_unknown_fields=True):
    id: str
    tenant: str
    salt: str
    hash: str
    created: str


class _File(Struct, forbid_unknown_fields=True):
    keys: list[_Entry]


class _Key(Struct, frozen=True):
    """An entry as looked up: salt and hash as bytes."""

    id: str
    tenant: str
    salt: bytes
    hash: bytes


def _digest(salt: bytes, key: str) -> bytes:
    # A fast hash on purpose: generated keys carry 256 bits of randomness, so a slow KDF would
    # only cost time on every request without making a brute force any less hopeless.
    return hashlib.sha256(salt + key.encode(errors="surrogatepass")).digest()


def _parse(data: bytes, path: str) -> list[_Entry]:
    try:
        entries = msgspec.json.decode(data, type=_File).keys
        for e in entries:
            if not bytes.fromhex(e.salt) or len(bytes.fromhex(e.hash)) != 32:
                raise ValueError(f"key {e.id}: empty salt or a hash that is not sha256")
    except (msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"malformed API keys file {path}: {e}") from None
    return entries


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    # The inode too: an atomic replace within one mtime tick may keep both mtime and size.
    return st.st_ino, st.st_mtime_ns, st.st_size


class KeyStore:
    """The keys in `path`; re-read when the file changes, so edits apply without a restart."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._stamp: tuple[int, int, int] | None = None
        self._keys: list[_Key] = []
        self._refresh(first=True)

    def tenant_for(self, key: str) -> str | None:
        """The tenant of a valid key, else None."""
        self._refresh()
        match = _GENERATED.fullmatch(key)
        # Generated keys name their entry (the id is public); other keys are tried against all.
        candidates = [k for k in self._keys if k.id == match[1]] if match else self._keys
        tenant = None
        for k in candidates:
            # No early exit: the time taken must not tell which entry matched.
            if hmac.compare_digest(_digest(k.salt, key), k.hash) and tenant is None:
                tenant = k.tenant
        return tenant

    def add(self, tenant: str, key: str | None = None) -> tuple[str, str]:
        """Store a key for `tenant` (a new random one when None); returns (id, key)."""
        if not _TENANT.fullmatch(tenant):
            raise ValueError(f"tenant {tenant!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if key is not None and (len(key) < _MIN_IMPORTED or not key.isprintable()
                                or any(c.isspace() for c in key)):
            raise ValueError(f"a key must be at least {_MIN_IMPORTED} characters, without "
                             "spaces or control characters")
        with self._locked() as entries:
            if key is not None and any(hmac.compare_digest(
                    _digest(bytes.fromhex(e.salt), key), bytes.fromhex(e.hash)) for e in entries):
                raise ValueError("this key is already stored")
            taken = {e.id for e in entries}
            match = _GENERATED.fullmatch(key) if key is not None else None
            if match:
                # A key in the generated format is found by the id inside it, so it keeps that id.
                key_id = match[1]
                if key_id in taken:
                    raise ValueError(f"a key with id {key_id} is already stored")
            else:
                key_id = secrets.token_hex(4)
                while key_id in taken:
                    key_id = secrets.token_hex(4)
            if key is None:
                key = f"sk-surge-{key_id}-{secrets.token_urlsafe(32)}"
            salt = secrets.token_bytes(16)
            created = datetime.now(UTC).isoformat(timespec="seconds")
            entries.append(_Entry(key_id, tenant, salt.hex(), _digest(salt, key).hex(), created))
        return key_id, key

    def remove(self, key_id: str) -> bool:
        """Delete the key with this id; False if there is none."""
        with self._locked() as entries:
            kept = [e for e in entries if e.id != key_id]
            found = len(kept) < len(entries)
            entries[:] = kept
        return found

    def entries(self) -> list[dict[str, str]]:
        """id, tenant and creation time of every key (never the hash or salt)."""
        return [{"id": e.id, "tenant": e.tenant, "created": e.created} for e in self._read()]

    def _refresh(self, first: bool = False) -> None:
        """Reload if the file changed since the last load (a missing file holds no keys)."""
        try:
            if _stamp(os.stat(self.path)) == self._stamp:
                return
            with open(self.path, "rb") as f:
                # The stamp of what is read, even if the file was replaced since the stat.
                self._stamp = _stamp(os.fstat(f.fileno()))
                data = f.read()
        except FileNotFoundError:
            self._stamp, self._keys = None, []
            return
        except OSError as e:
            if first:
                raise ValueError(f"cannot read API keys file {self.path}: {e}") from None
            log.error("cannot read API keys file %s (keeping the previous keys): %s",
                      self.path, e)
            return
        try:
            entries = _parse(data, self.path)
        except ValueError as e:
            if first:
                raise
            log.error("%s; keeping the previous keys", e)
            return
        self._keys = [_Key(e.id, e.tenant, bytes.fromhex(e.salt), bytes.fromhex(e.hash))
                      for e in entries]

    def _read(self) -> list[_Entry]:
        try:
            with open(self.path, "rb") as f:
                return _parse(f.read(), self.path)
        except FileNotFoundError:
            return []

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Exclusive over other writers (another `surge admin keys`) through a lock file."""
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[_Entry]]:
        """The entries on disk, to change in place; written back atomically on success."""
        with self._lock():
            entries = self._read()
            yield entries
            self._write(entries)
        self._refresh()

    def _write(self, entries: list[_Entry]) -> None:
        directory = os.path.dirname(self.path)
        # mkstemp creates the file with mode 0600, so hashes are never readable by others.
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(self.path)}.")
        try:
            with contextlib.suppress(OSError):
                # Keep the owner: root editing the file of a service user must leave it
                # readable by that user (a no-op for the owner itself).
                owner = os.stat(self.path)
                os.fchown(fd, owner.st_uid, owner.st_gid)
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(_File(entries)), indent=2) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # so the rename itself survives a crash
        finally:
            os.close(dir_fd)


class Keys:
    """What a server accepts: one fixed key (--api-key, tenant 'default') and/or a keys file."""

    def __init__(self, api_key: str | None, store: KeyStore | None) -> None:
        self.api_key = api_key
        self.store = store

    @classmethod
    def of(cls, api_key: str | None, path: str | None) -> Keys | None:
        """None when neither is set: then no request needs a key."""
        if not api_key and not path:
            return None
        return cls(api_key or None, KeyStore(path) if path else None)

    def tenant_for(self, key: str) -> str | None:
        """The tenant of a valid key, else None."""
        if self.api_key is not None and hmac.compare_digest(key.encode(errors="surrogatepass"),
                                                            self.api_key.encode()):
            return "default"
        return self.store.tenant_for(key) if self.store is not None else None
