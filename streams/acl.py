"""Who may do what on a secure broker: the roles of DESIGN §5 as Kafka ACLs, and the SCRAM users that hold them.

| role | may |
|---|---|
| `admin` | write `chipledger.quota` (quota grants, bursts: the fleet admins) |
| `cluster` | write `chipledger.jobs` and `chipledger.chips` (cluster controllers, Slurm adapter, node agents) |
| `portal` | write `chipledger.quota` (burst requests of signed-in members) |
| `worker` | read the inputs and `chipledger.log`; write `chipledger.log`, the output topics and `chipledger.quota`'s `pool.tick`s; own every topic, consumer group and transactional id that starts with its app id (Faust's table changelogs, its group) |
| `sink` | read the output topics (and describe the inputs and the log: their ends); own the consumer group named like the user and those starting with `<user>.` |
| `reader` | read the input, log and output topics; own the consumer group named like the user and those starting with `<user>.` |

Topic ACLs say which topics a principal may write; what it may say there (event types, its own clusters' pools)
is checked by the worker on each signed record (streams/principals.py, schemas/roles.py). A user may hold several
roles (its ACLs are the union). Everything else is refused: the broker runs the
standard authorizer with `allow.everyone.if.no.acl.found=false`, and only the super user (`kafka-admin` on the
local broker) creates topics, users and ACLs. A user's roles are read back from its ACLs (`list_users`).

    add_user(conn, "team-a-reader", ["reader"], password)     # SCRAM-SHA-512 and -256, ACLs of its roles
    list_users(conn) -> [UserInfo(name, mechanisms, roles)]
    remove_user(conn, "team-a-reader")                         # credentials and ACLs
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from schemas import INPUT_TOPICS, OUTPUT_TOPICS
from schemas import topics as _topics
from schemas.topics import TOPIC_CHIPS, TOPIC_JOBS, TOPIC_QUOTA
from streams.clients import KafkaConnection, Secret, as_connection
from streams.topics import KafkaSetupError, admin_client, describe_error

__all__ = ["ROLES", "LOG_TOPIC", "UserInfo", "role_acls", "add_user", "remove_user", "list_users",
           "provision_defaults", "DEFAULT_USERS", "DEFAULT_WORKER_APP_ID"]

#: the sequenced log (streams/worker.py's sequencer writes it; h-stream15): named here so its ACLs exist already
LOG_TOPIC = getattr(_topics, "TOPIC_LOG", "chipledger.log")
DEFAULT_WORKER_APP_ID = "chipledger-worker"
ROLES = ("admin", "cluster", "portal", "worker", "sink", "reader")
#: every worker's app id starts with this, and only worker principals may be named so (their consumer groups, topics
#: and transactional ids): a reader named `chipledger-worker-eu` would own that worker's group and could commit its
#: offsets past events never folded
WORKER_PREFIX = "chipledger-worker"
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256")
#: the users `chipledger kafka up` creates: user name -> roles
DEFAULT_USERS = {"admin": ("admin",), "cluster": ("cluster",), "worker": ("worker",), "sink": ("sink",),
                 "reader": ("reader",)}
#: the roles that send input events: their users get a signing key and an entry in the principals registry
SIGNING_ROLES = ("admin", "cluster", "portal", "worker")


@dataclass(frozen=True)
class UserInfo:
    name: str
    mechanisms: tuple[str, ...]
    roles: tuple[str, ...]
    app_id: Optional[str] = None  # the worker role's prefix


def _own_groups(user: str) -> list[tuple]:
    """The consumer groups a sink or reader owns: the group named like the user, and those starting with
    `<user>.`. Never a bare prefix `<user>`: a user named `chipledger` would own the worker's group
    `chipledger-worker` and could commit its offsets past events the worker never folded."""
    return [("GROUP", user, "LITERAL", "READ"), ("GROUP", f"{user}.", "PREFIXED", "READ")]


def _check_not_over(name: str, roles: Iterable[str], app_id: str) -> None:
    """A user without the worker role may own no name of a worker's (its groups, topics, transactional ids): names
    starting with WORKER_PREFIX are the worker role's; and a worker's app id must start with it."""
    if "worker" not in roles and (name.startswith(WORKER_PREFIX) or name == app_id or app_id.startswith(f"{name}.")):
        raise ValueError(f"user name {name!r} would own the worker's consumer group {app_id!r} (names starting with "
                         f"{WORKER_PREFIX!r} are the worker role's): choose another name")
    if "worker" in roles and not app_id.startswith(WORKER_PREFIX):
        raise ValueError(f"a worker's app id must start with {WORKER_PREFIX!r} (reserved for workers), got {app_id!r}")


def _grants(role: str, user: str, app_id: str) -> list[tuple]:
    """(resource type, name, pattern, operation) of a role."""
    lit, pre = "LITERAL", "PREFIXED"
    if role in ("admin", "portal"):
        return [("TOPIC", TOPIC_QUOTA, lit, "WRITE")]
    if role == "cluster":
        return [("TOPIC", TOPIC_JOBS, lit, "WRITE"), ("TOPIC", TOPIC_CHIPS, lit, "WRITE")]
    if role == "worker":
        out = [("TOPIC", t, lit, "READ") for t in (*INPUT_TOPICS, LOG_TOPIC)]
        out += [("TOPIC", t, lit, "WRITE") for t in (LOG_TOPIC, *OUTPUT_TOPICS, TOPIC_QUOTA)]
        out += [("TOPIC", app_id, pre, "ALL"), ("GROUP", app_id, pre, "ALL"),
                ("TRANSACTIONAL_ID", app_id, pre, "ALL"), ("CLUSTER", "kafka-cluster", lit, "IDEMPOTENT_WRITE"),
                ("CLUSTER", "kafka-cluster", lit, "DESCRIBE_CONFIGS")]
        return out
    if role == "sink":  # DESCRIBE of the inputs and the log: the sink checks an item's origin against their ends
        return ([("TOPIC", t, lit, "READ") for t in OUTPUT_TOPICS] + _own_groups(user)
                + [("TOPIC", t, lit, "DESCRIBE") for t in (*INPUT_TOPICS, LOG_TOPIC)])
    if role == "reader":
        return ([("TOPIC", t, lit, "READ") for t in (*INPUT_TOPICS, LOG_TOPIC, *OUTPUT_TOPICS)]
                + _own_groups(user))
    raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")


def role_acls(roles: Iterable[str], user: str, app_id: str = DEFAULT_WORKER_APP_ID) -> list:
    """kafka-python ACL objects (ALLOW, any host) of `roles` for the principal User:`user`."""
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ResourcePattern, ResourceType
    from kafka.admin import ACLResourcePatternType as Pattern

    seen, out = set(), []
    for role in roles:
        for rtype, name, pattern, op in _grants(role, user, app_id):
            if (rtype, name, pattern, op) in seen:
                continue
            seen.add((rtype, name, pattern, op))
            out.append(ACL(principal=f"User:{user}", host="*", operation=ACLOperation[op],
                           permission_type=ACLPermissionType.ALLOW,
                           resource_pattern=ResourcePattern(ResourceType[rtype], name, Pattern[pattern])))
    return out


def _key(acl) -> tuple:
    rp = acl.resource_pattern
    return (rp.resource_type.name, rp.resource_name, rp.pattern_type.name, acl.operation.name)


def _principal_acls(admin, user: str) -> list:
    from kafka.admin import ACLFilter, ACLOperation, ACLPermissionType, ResourcePatternFilter, ResourceType
    from kafka.admin import ACLResourcePatternType as Pattern

    flt = ACLFilter(principal=f"User:{user}", host=None, operation=ACLOperation.ANY,
                    permission_type=ACLPermissionType.ANY,
                    resource_pattern=ResourcePatternFilter(ResourceType.ANY, None, Pattern.ANY))
    acls, error = admin.describe_acls(flt)
    if error is not None and getattr(error, "errno", 0):
        raise KafkaSetupError(f"describing the ACLs of {user} failed: {error.__name__}")
    return acls, flt


def _roles_of(acls, user: str) -> tuple[tuple[str, ...], Optional[str]]:
    have = {_key(a) for a in acls}
    app_id = next((a.resource_pattern.resource_name for a in acls
                   if a.resource_pattern.resource_type.name == "GROUP"
                   and a.resource_pattern.pattern_type.name == "PREFIXED" and a.operation.name == "ALL"), None)
    grants = {role: set(_grants(role, user, app_id or DEFAULT_WORKER_APP_ID)) for role in ROLES}
    matched = [r for r in ROLES if grants[r] <= have]
    # a role whose grants another matched role includes says nothing more (a reader can do what a sink does)
    roles = [r for r in matched if not any(o != r and grants[r] < grants[o] for o in matched)]
    if "admin" in roles and "portal" in roles:  # the same ACLs: which one it is, the principals registry says
        roles.remove("portal")
    return tuple(roles), (app_id if "worker" in roles else None)


def _check_user(name: str) -> None:
    if not name or any(c in name for c in ",=: \t\n") or name.startswith("-"):
        raise ValueError(f"bad user name {name!r}: no commas, '=', ':', spaces, and no leading '-'")


def add_user(conn: "str | KafkaConnection", name: str, roles: Iterable[str], password: "str | Secret",
             app_id: str = DEFAULT_WORKER_APP_ID, timeout_s: float = 30, may: Iterable[str] = ()) -> UserInfo:
    """Create or update the SCRAM user `name` (SCRAM-SHA-512 and -256, with `password`) and make its ACLs
    exactly those of `roles` (ACLs of roles it no longer has are deleted). `conn` must be a super user."""
    from kafka.admin import UserScramCredentialUpsertion

    _check_user(name)
    roles = tuple(dict.fromkeys(roles))
    _check_not_over(name, roles, app_id)
    if not roles:
        raise ValueError("give at least one role")
    for r in roles:
        if r not in ROLES:
            raise ValueError(f"unknown role {r!r} (roles: {', '.join(ROLES)})")
    if len(str.__str__(password)) < 8:
        raise ValueError("a password needs at least 8 characters")
    want = role_acls(roles, name, app_id)
    if set(may) and "cluster" in roles and not set(roles) & {"admin", "portal"}:
        # --may pools / quota / prices: those types go to chipledger.quota (schemas.topic_for); what the principal
        # may say there is still the worker's check (its clusters' pools, its --may types only)
        want += [a for a in role_acls(["admin"], name, app_id)]
    admin = admin_client(conn, timeout_s)
    try:
        for m in MECHANISMS:  # one request per mechanism: the broker takes one change per user and request
            up = UserScramCredentialUpsertion(name, m, str.__str__(password).encode("utf-8"), iterations=8192)
            errors = {u: e for u, e in admin.alter_user_scram_credentials([up]).items() if e}
            if errors:
                raise KafkaSetupError(f"setting the {m} credential of {name} failed: {errors[name]}")
        have, _ = _principal_acls(admin, name)
        stale = [a for a in have if _key(a) not in {_key(w) for w in want}]
        if stale:
            admin.delete_acls(stale)
        missing = [w for w in want if _key(w) not in {_key(a) for a in have}]
        if missing:
            result = admin.create_acls(missing)
            if result.get("failed"):
                raise KafkaSetupError(f"creating the ACLs of {name} failed: "
                                      f"{[describe_error(e) for _, e in result['failed']][:3]}")
    except KafkaSetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - kafka errors, named for the operator (never with the password)
        raise KafkaSetupError(f"adding Kafka user {name} at {as_connection(conn)}: {describe_error(exc)}") from None
    finally:
        admin.close()
    return UserInfo(name, MECHANISMS, roles, app_id if "worker" in roles else None)


def remove_user(conn: "str | KafkaConnection", name: str, timeout_s: float = 30) -> bool:
    """Delete the user's SCRAM credentials and ACLs. Returns False if it had neither."""
    from kafka.admin import UserScramCredentialDeletion

    admin = admin_client(conn, timeout_s)
    try:
        info = admin.describe_user_scram_credentials([name]).get(name) or {}
        mechs = [ci["mechanism"] for ci in info.get("credential_infos", [])]
        for m in mechs:
            admin.alter_user_scram_credentials([UserScramCredentialDeletion(name, m)])
        acls, flt = _principal_acls(admin, name)
        if acls:
            admin.delete_acls([flt])
        return bool(mechs or acls)
    except KafkaSetupError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise KafkaSetupError(f"removing Kafka user {name} at {as_connection(conn)}: {describe_error(exc)}") from None
    finally:
        admin.close()


def list_users(conn: "str | KafkaConnection", timeout_s: float = 30) -> list[UserInfo]:
    """Every SCRAM user with its mechanisms and the roles its ACLs give it."""
    admin = admin_client(conn, timeout_s)
    try:
        creds = admin.describe_user_scram_credentials()
        out = []
        for name in sorted(creds):
            mechs = tuple(sorted(ci["mechanism"].name.replace("_", "-") for ci in creds[name]["credential_infos"]))
            acls, _ = _principal_acls(admin, name)
            roles, app_id = _roles_of(acls, name)
            out.append(UserInfo(name, mechs, roles, app_id))
        return out
    except KafkaSetupError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise KafkaSetupError(f"listing Kafka users at {as_connection(conn)}: {describe_error(exc)}") from None
    finally:
        admin.close()


def provision_defaults(conn: KafkaConnection, secrets_dir: Path, timeout_s: float = 60,
                       clusters: Iterable[str] = ("*",)) -> dict[str, Path]:
    """The users of DEFAULT_USERS, each with a random password in `secrets_dir/<user>.password` (0600, made
    once; an existing file's password is set again, so a re-run keeps them), and the principals registry
    `secrets_dir/principals.json` with the producing users (admin, cluster: of `clusters`, worker) and their
    signing keys in `secrets_dir/<user>.key` (0600, kept once made). Returns user -> password file."""
    from streams.principals import Registry, RegistryError, read_key_file, write_secret_file

    import os
    import secrets

    secrets_dir = Path(secrets_dir)
    secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = {}
    for user, roles in DEFAULT_USERS.items():
        path = secrets_dir / f"{user}.password"
        if not path.is_file():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(24) + "\n")
        add_user(conn, user, roles, Secret(path.read_text().splitlines()[0]), timeout_s=timeout_s)
        out[user] = path
    registry_path = secrets_dir / PRINCIPALS_FILE
    try:
        registry = Registry.load(registry_path) if registry_path.is_file() else Registry(path=registry_path)
    except RegistryError:
        registry = Registry(path=registry_path)
    for user, roles in DEFAULT_USERS.items():
        if not set(roles) & set(SIGNING_ROLES):
            continue
        key_path = secrets_dir / f"{user}.key"
        key = None
        if key_path.is_file():
            try:
                key = read_key_file(key_path)
            except RegistryError:
                key = None
        entry = registry.put(user, roles, clusters if "cluster" in roles else (), key=key)
        if key is None:
            write_secret_file(key_path, entry.key.hex() + "\n")
    registry.save()
    return out


#: the principals registry of a local broker, in its secrets folder (the worker's `[kafka] principals_file`)
PRINCIPALS_FILE = "principals.json"


def local_connection(info: dict, user: Optional[str] = None) -> KafkaConnection:
    """The connection to a local broker (`streams.broker.up`/`status` info) as `user` (a default user, with
    its password file in the broker's secrets) or, by default, as the super user."""
    from streams import broker
    from streams.clients import read_password_file

    if not info.get("secure"):
        return KafkaConnection(bootstrap=info["bootstrap_servers"])
    name = user or broker.SUPER_USER
    key_file = Path(info["secrets_dir"]) / f"{name}.key"  # a producing default user signs (streams/principals.py)
    return KafkaConnection(bootstrap=info["bootstrap_servers"], security_protocol=info["security_protocol"],
                           sasl_mechanism="PLAIN" if name == broker.SUPER_USER else "SCRAM-SHA-512",
                           username=name, password=read_password_file(Path(info["secrets_dir"]) / f"{name}.password"),
                           ssl_cafile=info.get("ca_file"),
                           signing_key=key_file.read_text().strip() if key_file.is_file() else None)
