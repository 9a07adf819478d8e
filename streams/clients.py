"""Every Kafka client's connection settings, in one place: bootstrap, security protocol, SASL/SCRAM and TLS.

The `[kafka]` section of chipledger.toml (or `CHIPLEDGER_KAFKA_*`, see docs/configuration.md and
docs/security.md) becomes one `KafkaConnection`; each client asks it for its own settings:

    conn = connection_from_config(cfg.kafka, bootstrap=None)   # --bootstrap / options override the config
    KafkaProducer(**conn.kafka_python(), acks="all", ...)      # kafka-python: producer, consumer, admin
    AIOKafkaProducer(**conn.aiokafka())                        # aiokafka
    faust.App(..., broker=conn.faust_broker(), broker_credentials=conn.faust_credentials())

`emit` / `LedgerProducer`, `topics create`, the worker (Faust), the sink, `kafka users` and the adapters use
it; a plain `"host:port"` string is a PLAINTEXT connection (`as_connection`).

The password is a `Secret`: a `str` whose repr, str and format print `***`, so a settings dict that a library
logs (kafka-python logs its whole configuration at debug level), a repr of the connection, or an exception
message never shows it. The clients get the real characters (`.encode()`, what SCRAM hashes).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

__all__ = [
    "PROTOCOLS",
    "MECHANISMS",
    "KafkaConnection",
    "KafkaSecurityError",
    "Secret",
    "as_connection",
    "connection_from_config",
    "read_password_file",
]

PROTOCOLS = ("PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")  # PLAIN: the local broker's super user only


class KafkaSecurityError(ValueError):
    """The Kafka security settings are incomplete or unreadable (the message never holds a secret)."""


class Secret(str):
    """A password: the real characters for the client libraries, `***` wherever it could be printed."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return "***"

    def __format__(self, spec: str) -> str:
        return format("***", spec)

    def reveal(self) -> str:
        """The password as a plain str (for a library that copies it with str())."""
        return str.__str__(self)


def read_password_file(path: Union[str, Path]) -> Secret:
    """The password in `path` (its first line, without the line break); the error names the file only."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise KafkaSecurityError(f"cannot read the Kafka password file {p}: {exc.strerror or type(exc).__name__}") \
            from None
    line = text.splitlines()[0] if text else ""
    if not line:
        raise KafkaSecurityError(f"the Kafka password file {p} is empty")
    return Secret(line)


@dataclass(frozen=True)
class KafkaConnection:
    """Where the brokers are and how to authenticate to them. Build it with `connection_from_config`."""

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    username: Optional[str] = None
    password: Optional[Secret] = field(default=None, repr=False)
    ssl_cafile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    ssl_check_hostname: bool = True
    # the producer's signing key (streams/principals.py), 64 hex digits; the principal is `username`
    signing_key: Optional[Secret] = field(default=None, repr=False)

    def __post_init__(self):
        if self.security_protocol not in PROTOCOLS:
            raise KafkaSecurityError(f"[kafka] security_protocol must be one of {', '.join(PROTOCOLS)}, "
                                     f"got {self.security_protocol!r}")
        if self.sasl_mechanism not in MECHANISMS:
            raise KafkaSecurityError(f"[kafka] sasl_mechanism must be one of {', '.join(MECHANISMS)}, "
                                     f"got {self.sasl_mechanism!r}")
        if self.password is not None and not isinstance(self.password, Secret):
            object.__setattr__(self, "password", Secret(self.password))
        if self.signing_key is not None and not isinstance(self.signing_key, Secret):
            object.__setattr__(self, "signing_key", Secret(self.signing_key))
        if self.sasl:
            if not self.username:
                raise KafkaSecurityError(f"security protocol {self.security_protocol} needs a user name: set [kafka] "
                                         "username / CHIPLEDGER_KAFKA_USERNAME or pass --user")
            if not self.password:
                raise KafkaSecurityError(f"Kafka user {self.username!r} has no password: set [kafka] password_file / "
                                         "CHIPLEDGER_KAFKA_PASSWORD_FILE (or CHIPLEDGER_KAFKA_PASSWORD), or pass "
                                         "--password-file")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise KafkaSecurityError("[kafka] ssl_certfile and ssl_keyfile go together (a client certificate and "
                                     "its key)")
        for what in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, what)
            if path and not Path(path).expanduser().is_file():
                raise KafkaSecurityError(f"[kafka] {what}: {path} is not a file")

    # --- what it is -------------------------------------------------------------------------------------
    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def describe(self) -> str:
        """One line for logs and messages: address, protocol and user, never the password."""
        who = f", user {self.username} ({self.sasl_mechanism})" if self.sasl else ""
        return f"{self.bootstrap} ({self.security_protocol}{who})"

    def __str__(self) -> str:
        return self.describe()

    def signer(self) -> Optional[tuple[str, bytes]]:
        """(principal, signing key) when this connection signs what it produces, else None."""
        if not self.signing_key:
            return None
        return (self.username or ""), bytes.fromhex(self.signing_key.reveal())

    def with_bootstrap(self, bootstrap: Optional[str]) -> "KafkaConnection":
        return self if not bootstrap else replace(self, bootstrap=bootstrap)

    def ssl_context(self) -> Optional[ssl.SSLContext]:
        """The TLS context of SSL / SASL_SSL (the CA file, else the system's CAs; the client certificate when
        given), None for PLAINTEXT / SASL_PLAINTEXT."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                             cafile=str(Path(self.ssl_cafile).expanduser()) if self.ssl_cafile
                                             else None)
            ctx.check_hostname = self.ssl_check_hostname
            if not self.ssl_check_hostname:
                ctx.verify_mode = ssl.CERT_REQUIRED  # the certificate is still checked against the CA
            if self.ssl_certfile:
                ctx.load_cert_chain(str(Path(self.ssl_certfile).expanduser()),
                                    str(Path(self.ssl_keyfile).expanduser()))
        except (OSError, ssl.SSLError) as exc:
            raise KafkaSecurityError(f"cannot load the Kafka TLS files (ca {self.ssl_cafile}, cert "
                                     f"{self.ssl_certfile}): {exc}") from None
        return ctx

    # --- per client library -----------------------------------------------------------------------------
    def security_settings(self) -> dict[str, Any]:
        """The security keyword arguments shared by kafka-python and aiokafka (no bootstrap)."""
        if self.sasl_mechanism.startswith("SCRAM") and not self.tls:
            # kafka-python warns "Exchanging credentials in the clear" on every SCRAM connection without TLS:
            # SCRAM never sends the password (a salted proof only), so the warning says what does not happen
            import logging

            logging.getLogger("kafka.net.sasl.scram").setLevel(logging.ERROR)
        out: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.sasl:
            out.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.username,
                       sasl_plain_password=self.password)
        ctx = self.ssl_context()
        if ctx is not None:
            out["ssl_context"] = ctx
        return out

    def kafka_python(self) -> dict[str, Any]:
        """Keyword arguments for kafka-python's KafkaProducer, KafkaConsumer and KafkaAdminClient."""
        return {"bootstrap_servers": self.bootstrap, **self.security_settings()}

    def aiokafka(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's AIOKafkaProducer / AIOKafkaConsumer / AIOKafkaAdminClient."""
        return {"bootstrap_servers": self.bootstrap, **self.security_settings()}

    def faust_broker(self) -> str:
        """Faust's `broker` setting: one kafka:// URL per bootstrap server."""
        return ";".join(f"kafka://{h.strip()}" for h in self.bootstrap.split(",") if h.strip())

    def faust_credentials(self):
        """Faust's `broker_credentials`: SASLCredentials (with the TLS context for SASL_SSL), SSLCredentials for
        SSL, None for PLAINTEXT."""
        if self.security_protocol == "PLAINTEXT":
            return None
        import faust

        if self.sasl:
            return faust.SASLCredentials(username=self.username, password=self.password,
                                         mechanism=self.sasl_mechanism, ssl_context=self.ssl_context())
        return faust.SSLCredentials(self.ssl_context())


def as_connection(bootstrap_or_connection: Union[str, KafkaConnection, None]) -> KafkaConnection:
    """A KafkaConnection as it is, or a bootstrap address as a PLAINTEXT connection."""
    if isinstance(bootstrap_or_connection, KafkaConnection):
        return bootstrap_or_connection
    if not bootstrap_or_connection:
        return KafkaConnection()
    return KafkaConnection(bootstrap=str(bootstrap_or_connection))


def connection_from_config(kafka_cfg, *, bootstrap: Optional[str] = None, username: Optional[str] = None,
                           password_file: Optional[Union[str, Path]] = None,
                           ssl_cafile: Optional[Union[str, Path]] = None,
                           signing_key_file: Optional[Union[str, Path]] = None) -> KafkaConnection:
    """The connection of a `[kafka]` section (chipledger.config.KafkaConfig, env overrides applied), with the
    command-line overrides (None: the config's). An empty `security_protocol` means: SASL_SSL with a user and
    a CA file, SASL_PLAINTEXT with a user, SSL with a CA file only, else PLAINTEXT.

    The password is the password file's first line when a file is given (option or config), else `[kafka]
    password` (best set as CHIPLEDGER_KAFKA_PASSWORD, never in a file others can read)."""
    user = username if username is not None else (kafka_cfg.username or None)
    pw_file = password_file if password_file is not None else (kafka_cfg.password_file or None)
    cafile = str(ssl_cafile) if ssl_cafile is not None else (kafka_cfg.ssl_cafile or None)
    password: Optional[Secret] = None
    if pw_file:
        password = read_password_file(pw_file)
    elif kafka_cfg.password:
        password = Secret(kafka_cfg.password)
    # the signing key: the option, [kafka] signing_key_file, else `<user>.key` beside the password file (where `kafka
    # up` and `kafka users add` write it)
    key_file = signing_key_file or getattr(kafka_cfg, "signing_key_file", "") or None
    if key_file is None and pw_file and user:
        beside = Path(pw_file).expanduser().with_name(f"{Path(pw_file).stem}.key")
        key_file = beside if beside.is_file() else None
    signing_key = None
    if key_file:
        from streams.principals import RegistryError, read_key_file

        try:
            signing_key = Secret(read_key_file(key_file).hex())
        except RegistryError as exc:
            raise KafkaSecurityError(str(exc)) from None
    protocol = (kafka_cfg.security_protocol or "").strip().upper()
    if not protocol:
        protocol = ("SASL_SSL" if cafile else "SASL_PLAINTEXT") if user else ("SSL" if cafile else "PLAINTEXT")
    return KafkaConnection(
        bootstrap=bootstrap or kafka_cfg.bootstrap,
        security_protocol=protocol,
        sasl_mechanism=(kafka_cfg.sasl_mechanism or "SCRAM-SHA-512").strip().upper(),
        username=user,
        password=password,
        ssl_cafile=cafile,
        ssl_certfile=kafka_cfg.ssl_certfile or None,
        ssl_keyfile=kafka_cfg.ssl_keyfile or None,
        ssl_check_hostname=kafka_cfg.ssl_check_hostname,
        signing_key=signing_key,
    )


def env_password(name: str = "CHIPLEDGER_KAFKA_PASSWORD") -> Optional[Secret]:
    """The password of an environment variable as a Secret (for scripts that build a connection by hand)."""
    value = os.environ.get(name)
    return Secret(value) if value else None
