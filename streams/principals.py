"""Who sent a record, from something the producer cannot forge: signed records and the principals registry.

Kafka records carry no principal (the broker knows the SASL user of a connection, a consumer never sees it), and a
record's `source` or headers are claims. So every producer signs: the SDK (streams/producer.py) adds the headers

- `chipledger-principal`: the principal's name (its SCRAM user name);
- `chipledger-sig`: `v1=` and the hex HMAC-SHA256, with the principal's signing key, of `signed_bytes(...)`: the
  message key (the pool), the sequencer headers (`chipledger-producer`, `-seq`, `-prev`, empty when absent) and
  the value, each as a 4-byte big-endian length and its bytes. A copied signature is good for nothing else: not
  for another pool, another place in a producer's order, or another body.

The worker verifies each input record against the registry (`Registry.verify`) before the sequencer: no or a
malformed signature, an unknown principal or a wrong HMAC is `bad_signature`; then `schemas.roles.check` decides
`wrong_role` / `not_owner` (the one place of that rule). Only what passes is logged, with the principal and the
cluster it was accepted from (`origin`).

The registry is one JSON file (0600: it holds every principal's key), written by `chipledger kafka users add /
remove` and read by the worker (again whenever the file changes):

    {"format": 1, "principals": {"slurm-east": {"roles": ["cluster"], "clusters": ["us-east1-a"],
                                                "may": ["quota"], "key": "<64 hex digits>"}}}

A producer holds only its own key (`[kafka] signing_key_file`, 0600; `kafka users add` writes it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

from schemas.codes import Rejection, RejectionCode
from schemas.roles import ALL_CLUSTERS, Principal, check, pool_cluster

HEADER_PRINCIPAL = "chipledger-principal"
HEADER_SIG = "chipledger-sig"
SIG_PREFIX = b"v1="
KEY_BYTES = 32
REGISTRY_FORMAT = 1
#: the sequencer's headers, signed with the record (streams/sequencer.py names them; repeated here: no import cycle)
_STAMP_HEADERS = ("chipledger-producer", "chipledger-seq", "chipledger-prev")
BAD_SIGNATURE = getattr(RejectionCode, "bad_signature", RejectionCode.bad_key)

log = logging.getLogger(__name__)


class RegistryError(ValueError):
    """The principals registry cannot be read or written (the message never holds a key)."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def signed_bytes(key: bytes, value: bytes, stamp: Iterable[bytes]) -> bytes:
    """What a signature covers: the message key, the three sequencer header values and the value, each length-
    prefixed (4 bytes, big-endian)."""
    parts = [b"chipledger-sig/1", key or b"", *stamp, value or b""]
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def _stamp_values(headers) -> list[bytes]:
    found = {name: value for name, value in headers or () if name in _STAMP_HEADERS}
    return [bytes(found.get(name) or b"") for name in _STAMP_HEADERS]


def sign(signing_key: bytes, key: bytes, value: bytes, headers=()) -> bytes:
    """The `chipledger-sig` header value of a record (`headers`: its sequencer headers, as sent)."""
    mac = hmac.new(signing_key, signed_bytes(key, value, _stamp_values(headers)), hashlib.sha256)
    return SIG_PREFIX + mac.hexdigest().encode("ascii")


def read_key_file(path: Union[str, Path]) -> bytes:
    """A signing key file: its first line, 64 hex digits (the error names the file only)."""
    p = Path(path).expanduser()
    try:
        line = (p.read_text(encoding="ascii").splitlines() or [""])[0].strip()
        key = bytes.fromhex(line)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RegistryError(f"cannot read the signing key file {p}: "
                            f"{getattr(exc, 'strerror', None) or 'not 64 hex digits'}") from None
    if len(key) != KEY_BYTES:
        raise RegistryError(f"the signing key file {p} does not hold {KEY_BYTES * 2} hex digits")
    return key


def write_secret_file(path: Union[str, Path], text: str) -> None:
    """Write `text` to `path` with mode 0600 (replacing it atomically)."""
    p = Path(path).expanduser()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, p)


@dataclass(frozen=True)
class Entry:
    principal: Principal
    key: bytes

    def as_json(self) -> dict:
        p = self.principal
        return {"roles": sorted(p.roles), "clusters": sorted(p.clusters), "may": sorted(p.may), "key": self.key.hex()}


@dataclass(frozen=True)
class Accepted:
    """A record whose signature checked and whose principal may send it: who, and the cluster it came from
    (`origin`, what the core deduplicates ids by: the pool's cluster, or `*` for a principal of every cluster)."""

    principal: str
    origin: str


class Registry:
    """The principals by name, with their signing keys."""

    def __init__(self, entries: Optional[dict[str, Entry]] = None, path: Optional[Path] = None):
        self.entries: dict[str, Entry] = dict(entries or {})
        self.path = path
        self._stamp: Optional[tuple] = None

    # --- file ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Union[str, Path]) -> "Registry":
        reg = cls(path=Path(path).expanduser())
        reg.reload()
        return reg

    def _file_stamp(self) -> Optional[tuple]:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode)  # a chmod is a change too

    def reload(self) -> bool:
        """Read the file again if it changed since the last read; True when it did. A file that cannot be read
        now keeps the last good registry (and raises only on the first read)."""
        stamp = self._file_stamp()
        if stamp is not None and stamp == self._stamp:
            return False
        try:
            self.entries = _parse(self.path)
        except RegistryError as exc:
            if self._stamp is None:
                raise
            log.error("principals registry not read again, the last good one is kept: %s", exc)
            self._stamp = stamp  # said once per change of the file
            return False
        self._stamp = stamp
        return True

    def save(self) -> None:
        if self.path is None:
            raise RegistryError("this registry has no file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": REGISTRY_FORMAT,
                "principals": {n: self.entries[n].as_json() for n in sorted(self.entries)}}
        write_secret_file(self.path, json.dumps(data, indent=1) + "\n")

    # --- changes ------------------------------------------------------------------------------------------
    def put(self, name: str, roles: Iterable[str], clusters: Iterable[str] = (), may: Iterable[str] = (),
            key: Optional[bytes] = None) -> Entry:
        """Add or change a principal; its key is kept unless `key` is given (a new principal gets a new one)."""
        roles, clusters, may = frozenset(roles), frozenset(clusters), frozenset(may)
        if "admin" in roles or "worker" in roles:
            clusters = frozenset({ALL_CLUSTERS})
        principal = Principal(name, roles, clusters, may)
        if may and "cluster" not in roles:
            raise RegistryError("--may gives a cluster principal more rights: it needs --role cluster")
        if roles & {"cluster", "portal"} and not clusters:
            raise RegistryError(f"a {'/'.join(sorted(roles & {'cluster', 'portal'}))} principal speaks for its "
                                "own clusters' pools only: give --cluster NAME (repeatable)")
        old = self.entries.get(name)
        entry = Entry(principal, key or (old.key if old is not None else new_key()))
        self.entries[name] = entry
        return entry

    def remove(self, name: str) -> bool:
        return self.entries.pop(name, None) is not None

    # --- the check ----------------------------------------------------------------------------------------
    def verify(self, key: Optional[bytes], value: bytes, headers) -> Union[Accepted, Rejection]:
        """Who sent this record, and may they: `Accepted`, or a Rejection (`bad_signature`, `wrong_role`,
        `not_owner`). The type and pool are read from the value only when the signature checked."""
        name = sig = None
        for hname, hvalue in headers or ():
            if hname == HEADER_PRINCIPAL:
                name = hvalue
            elif hname == HEADER_SIG:
                sig = hvalue
        if name is None or sig is None:
            return Rejection(BAD_SIGNATURE, "the record is not signed (no chipledger-principal / chipledger-sig "
                                            "headers): producers sign with their principal's key (docs/security.md)")
        try:
            who = bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            return Rejection(BAD_SIGNATURE, "the chipledger-principal header is not UTF-8")
        entry = self.entries.get(who)
        if entry is None:
            return Rejection(BAD_SIGNATURE, f"unknown principal {who[:64]!r} (not in the principals registry, or "
                                            "removed)")
        want = sign(entry.key, key or b"", value, headers)
        if not hmac.compare_digest(want, bytes(sig)):
            return Rejection(BAD_SIGNATURE, f"the signature of principal {who[:64]!r} does not check (another key, "
                                            "or the key, value or sequencer headers changed after signing)")
        etype, pool, body = _type_and_pool(value, key)
        if etype is None:
            # not an event the roles can be checked on (not JSON, no type): the fold dead-letters it by its own
            # rule, with the principal known
            return Accepted(who, _origin(entry.principal, pool or ""))
        rejection = check(entry.principal, etype, pool)
        if rejection is not None:
            return rejection
        if (etype == "burst.requested" and "portal" in entry.principal.roles and "admin" not in entry.principal.roles
                and not body.get("requested_by")):
            # DESIGN §3: the portal asks for the signed-in member, and says who (an admin may ask in no one's name)
            return Rejection(RejectionCode.wrong_role, f"principal {who[:64]!r} (portal) may send burst.requested "
                                                       "only with requested_by (the signed-in member)")
        return Accepted(who, _origin(entry.principal, pool))


def _origin(principal: Principal, pool: str) -> str:
    return ALL_CLUSTERS if ALL_CLUSTERS in principal.clusters else pool_cluster(pool)


def _type_and_pool(value: bytes, key: Optional[bytes]) -> tuple[Optional[str], str, dict]:
    import orjson

    pool = (key or b"").decode("utf-8", "replace")
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None, pool, {}
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        return None, pool, {}
    if isinstance(body.get("pool"), str):
        pool = body["pool"]
    return body["type"], pool, body


def _parse(path: Path) -> dict[str, Entry]:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0  # (the read below says why)
    if os.name == "posix" and mode & 0o077:
        raise RegistryError(f"the principals registry {path} is readable by other users: it holds every "
                            f"producer's signing key (chmod 600 {path})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RegistryError(f"the principals registry {path} does not exist (`chipledger kafka up` makes one; "
                            "`chipledger kafka users add` adds to it)") from None
    except (OSError, ValueError) as exc:
        raise RegistryError(f"cannot read the principals registry {path}: "
                            f"{getattr(exc, 'strerror', None) or 'not JSON'}") from None
    if not isinstance(data, dict) or data.get("format") != REGISTRY_FORMAT or not isinstance(
            data.get("principals"), dict):
        raise RegistryError(f"{path} is not a principals registry of format {REGISTRY_FORMAT}")
    out = {}
    for name, d in data["principals"].items():
        try:
            key = bytes.fromhex(d["key"])
            if len(key) != KEY_BYTES:
                raise ValueError("key length")
            out[name] = Entry(Principal(name, frozenset(d["roles"]), frozenset(d.get("clusters") or ()),
                                        frozenset(d.get("may") or ())), key)
        except (KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"{path}: principal {name!r} is malformed ({type(exc).__name__})") from None
    return out
