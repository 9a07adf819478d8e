"""Configuration: `chipledger.toml` (every key optional) overridden by environment variables.

An environment variable `CHIPLEDGER_<SECTION>_<KEY>` overrides `[section] key`, e.g.
`CHIPLEDGER_STORE_URL=postgresql://…` or `CHIPLEDGER_KAFKA_BOOTSTRAP=127.0.0.1:9092`. Command-line options
override both. Defaults and meanings are documented in docs/configuration.md.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from analytics.slo_views import SloParams as SloConfig  # the [slo] section: targets and thresholds of the SLO views
from ledger.fold import DEFAULT_DEDUP_WINDOW_S, DEFAULT_MAX_CLOCK_JUMP_S, DEFAULT_MAX_CLOCK_SKEW_S, FoldConfig
from schemas.parse import DEFAULT_MAX_EVENT_BYTES


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class KafkaConfig:
    """[kafka]: where the brokers are and how every client authenticates (docs/security.md)."""

    bootstrap: str = "127.0.0.1:9092"
    partitions: int = 3
    security_protocol: str = ""  # PLAINTEXT | SASL_PLAINTEXT | SASL_SSL | SSL; "": from username / ssl_cafile
    sasl_mechanism: str = "SCRAM-SHA-512"  # or SCRAM-SHA-256
    username: str = ""
    password: str = field(default="", repr=False)  # prefer password_file or CHIPLEDGER_KAFKA_PASSWORD
    password_file: str = ""  # a file whose first line is the password
    ssl_cafile: str = ""  # the CA that signed the brokers' certificates (PEM)
    ssl_certfile: str = ""  # a client certificate (PEM), with ssl_keyfile, when the brokers ask for one
    ssl_keyfile: str = ""
    ssl_check_hostname: bool = True
    # producers: the principal's signing key (64 hex digits; default `<user>.key` beside password_file)
    signing_key_file: str = ""
    # the worker: the principals registry (streams/principals.py); every input record must be signed by one
    principals_file: str = ""


@dataclass(frozen=True)
class StoreConfig:
    url: str = "sqlite:///chipledger.db"


@dataclass(frozen=True)
class LakeConfig:
    path: str = "lake"
    # DuckDB's settings for the commands that read the lake (report, statements, sql, alerts, pending, why): the
    # memory it may take ("" = DuckDB's default, 80% of the machine's) and the folder it spills what does not fit to
    # ("" = DuckDB's default, `.tmp` in the working directory). docs/analytics.md, "A lake larger than the memory"
    memory_limit: str = ""
    spill_dir: str = ""

    def __post_init__(self):
        if self.memory_limit.strip():
            m = _MEMORY.fullmatch(self.memory_limit.strip())
            amount = float(m.group(1)) * _UNITS[m.group(2).upper()] if m else 0
            if not MIN_MEMORY <= amount <= MAX_MEMORY:
                raise ValueError(f"[lake] memory_limit must be an amount of memory from 1MB to 1PB such as 10GB, "
                                 f"512MB or 1.5GiB, got {self.memory_limit!r}")
        spill = self._spill_path()
        if spill is not None and spill.exists() and not spill.is_dir():
            raise ValueError(f"[lake] spill_dir must be a folder (DuckDB creates it if it does not exist), and "
                             f"{self.spill_dir!r} is a file")

    def _spill_path(self) -> Optional[Path]:
        return Path(self.spill_dir.strip()).expanduser() if self.spill_dir.strip() else None

    def duckdb_config(self) -> Optional[dict[str, str]]:
        """The DuckDB settings to open the lake with (analytics.views.connect's `config`), or None."""
        cfg = {}
        if self.memory_limit.strip():
            cfg["memory_limit"] = self.memory_limit.strip()
        if self._spill_path() is not None:
            cfg["temp_directory"] = str(self._spill_path())
        return cfg or None


_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*(B|[KMGT]i?B)", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MIN_MEMORY, MAX_MEMORY = 1e6, 1e15


# a dead letter carries the raw bytes of a too_large message up to max_event_bytes, in base64 (4/3 larger),
# and must fit one Kafka record of the default 1 MiB limit
MAX_EVENT_BYTES_LIMIT = 720 * 1024


@dataclass(frozen=True)
class LedgerConfig:
    dedup_window_s: int = DEFAULT_DEDUP_WINDOW_S
    debug_invariants: bool = False  # check conservation after every event (slower)
    max_clock_jump_s: int = DEFAULT_MAX_CLOCK_JUMP_S  # an event further ahead of its pool clock: clock_jump
    max_clock_skew_s: int = DEFAULT_MAX_CLOCK_SKEW_S  # an event further ahead of its append time: clock_ahead
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES  # a message value over this: too_large (docs/events.md)
    hol_blocking: bool = True  # the fold measures head-of-line blocking (waits.blocked_s; 2-3x the fold's cost per event)

    def __post_init__(self):
        if self.max_clock_jump_s < 1:
            raise ValueError(f"[ledger] max_clock_jump_s must be at least 1, got {self.max_clock_jump_s}")
        if self.max_clock_skew_s < 0:
            raise ValueError(f"[ledger] max_clock_skew_s must not be negative, got {self.max_clock_skew_s}")
        if self.dedup_window_s < 0:
            raise ValueError(f"[ledger] dedup_window_s must not be negative, got {self.dedup_window_s}")
        if not 1024 <= self.max_event_bytes <= MAX_EVENT_BYTES_LIMIT:
            raise ValueError(f"[ledger] max_event_bytes must be between 1024 and {MAX_EVENT_BYTES_LIMIT}, "
                             f"got {self.max_event_bytes}")


_FOLD_DEFAULTS = FoldConfig()


@dataclass(frozen=True)
class PolicyConfig:
    """[policy]: fair share, preemption and bursts (docs/policy.md). Defaults are FoldConfig's."""

    decay_half_life_s: int = _FOLD_DEFAULTS.decay_half_life_s
    preemption_grace_s: int = _FOLD_DEFAULTS.preemption_grace_s
    min_runtime_s: int = _FOLD_DEFAULTS.min_runtime_s
    max_preemptions: int = _FOLD_DEFAULTS.max_preemptions
    preemption_window_s: int = _FOLD_DEFAULTS.preemption_window_s
    decision_timeout_s: int = _FOLD_DEFAULTS.decision_timeout_s
    candidates_per_team: int = _FOLD_DEFAULTS.candidates_per_team
    victim_order: str = _FOLD_DEFAULTS.victim_order
    fair_share_tolerance: float = _FOLD_DEFAULTS.fair_share_tolerance
    restart_cost_s: int = _FOLD_DEFAULTS.restart_cost_s
    checkpoint_grace_s: int = _FOLD_DEFAULTS.checkpoint_grace_s

    def __post_init__(self):
        try:
            FoldConfig(**self.fold_kwargs())
        except ValueError as err:
            raise ValueError(f"[policy] {err}") from None

    def fold_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fold_config(cfg: "Config", check_invariants: bool = False) -> FoldConfig:
    """The FoldConfig of a configuration: [ledger] and [policy] (what every command that folds uses)."""
    return FoldConfig(dedup_window_s=cfg.ledger.dedup_window_s, max_clock_jump_s=cfg.ledger.max_clock_jump_s,
                      max_clock_skew_s=cfg.ledger.max_clock_skew_s,
                      check_invariants=check_invariants or cfg.ledger.debug_invariants,
                      hol_blocking=cfg.ledger.hol_blocking,
                      capacity_slo_target=cfg.slo.availability,  # bursts are gated by the capacity SLO's budget
                      **cfg.slo.fold_kwargs(), **cfg.policy.fold_kwargs())


@dataclass(frozen=True)
class StatementsConfig:
    out: str = "statements"              # folder the statements are written into (one subfolder per period)
    formats: str = "md,html,csv,json"    # comma-separated: md, html, csv, json
    every: str = "month"                 # the period `chipledger statements --every` issues by default

    def __post_init__(self):
        from chipledger.reports.statements import StatementError, parse_formats

        try:
            parse_formats(self.formats)
        except StatementError as err:
            raise ValueError(f"[statements] formats: {err}") from None
        if self.every not in ("week", "month"):
            raise ValueError(f"[statements] every must be week or month, got {self.every!r}")


@dataclass(frozen=True)
class WorkerConfig:
    """The Kafka worker and sink (docs/streaming.md)."""

    data_dir: str = ".chipledger-worker"  # the worker's table state (rocksdb files)
    table_store: str = "rocksdb"  # rocksdb | memory
    sequencer_wait_ms: int = 60_000  # how long a record waits for its producer's previous one, topics caught up
    sequencer_block_ms: int = 2_000  # ... and how long when another producer's records wait behind it
    session_timeout_s: float = 6.0  # a dead worker's pools move to another after this (Kafka's minimum: 6 s)
    tick_interval_s: int = 60  # a pool quiet this long gets a pool.tick closing past hours; 0: no ticks
    fetch_max_wait_ms: int = 20  # how long the broker may hold a fetch of the input topics (Faust fixes 1,500)
    checkpoint_interval_ms: int = 500  # how often the worker writes its states and commits what they hold
    log_stalls_ms: int = 0  # log each event-loop stall of the worker longer than this (what held it); 0: off


@dataclass(frozen=True)
class BacktestConfig:
    """[backtest]: what `chipledger backtest` changes besides [policy] (docs/backtest.md)."""

    quota: str = ""          # team=chips,… (every pool) or pool:team=chips,…; overrides the log's grants
    act_delay_s: int = 10    # the simulated cluster acts on a decision this long after it
    coop_share: float = 0.0  # share of victims that checkpoint on notice before they are preempted

    def __post_init__(self):
        if self.act_delay_s < 0:
            raise ValueError(f"[backtest] act_delay_s must not be negative, got {self.act_delay_s}")
        if not 0.0 <= self.coop_share <= 1.0:
            raise ValueError(f"[backtest] coop_share must be between 0 and 1, got {self.coop_share}")


SERVE_ROLES = ("member", "admin", "sre")


@dataclass(frozen=True)
class ServeConfig:
    """`chipledger serve` (docs/portal.md): where it listens, who is who, what a team member may see."""

    host: str = "127.0.0.1"              # loopback unless configured
    port: int = 8470
    # who is who: comma-separated `NAME=TEAM:ROLE`, NAME a user or `group:GROUP` (the proxy's groups), TEAM a team
    # or `*` (every team: admins, SREs), ROLE member | admin | sre; e.g. "alice=vision:member, group:sre=*:sre"
    members: str = ""
    # what a team member sees of other teams: "fleet" (pool totals, SLOs and other teams' balances), "team" (only
    # their own team's; pool totals without other teams' names)
    visibility: str = "fleet"
    # an authenticating proxy (oauth2-proxy and the like): its addresses, comma-separated; only requests from them
    # may name the user (and groups) in these headers
    trusted_proxies: str = ""
    user_header: str = "X-Forwarded-User"
    groups_header: str = "X-Forwarded-Groups"
    refresh_s: float = 5.0               # how often the lake is looked at for new commits
    writes_per_minute: int = 10          # burst requests (and other writes) per user and minute
    # every request (API and pages), per signed-in user, else per client address; 0: no limit
    requests_per_minute: int = 600
    session_hours: float = 12.0          # a browser session (after /login) ends after this, or at sign-out
    secure_cookies: bool = False         # the session cookie only over HTTPS (set it behind TLS)
    kafka: bool = False                  # send burst requests through [kafka] (also: `serve --bootstrap`)

    def __post_init__(self):
        if self.visibility not in ("fleet", "team"):
            raise ValueError(f"[serve] visibility must be fleet or team, got {self.visibility!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"[serve] port must be 1..65535, got {self.port}")
        if self.refresh_s <= 0 or self.writes_per_minute <= 0:
            raise ValueError("[serve] refresh_s and writes_per_minute must be more than 0")
        if self.requests_per_minute < 0:
            raise ValueError(f"[serve] requests_per_minute must be 0 (no limit) or more, got {self.requests_per_minute}")
        if self.session_hours <= 0:
            raise ValueError(f"[serve] session_hours must be more than 0, got {self.session_hours}")
        self.memberships()

    def memberships(self) -> dict[str, list[tuple[str, str]]]:
        """NAME (user, or `group:G`) -> [(team or '*', role)]."""
        out: dict[str, list[tuple[str, str]]] = {}
        for item in (x.strip() for x in self.members.split(",")):
            if not item:
                continue
            name, sep, rest = item.partition("=")
            team, sep2, role = rest.partition(":")
            name, team, role = name.strip(), team.strip(), role.strip()
            if not sep or not sep2 or not name or not team or role not in SERVE_ROLES:
                raise ValueError(f"[serve] members: {item!r} is not NAME=TEAM:ROLE with ROLE one of "
                                 f"{', '.join(SERVE_ROLES)}")
            out.setdefault(name, []).append((team, role))
        return out

    def proxies(self) -> frozenset[str]:
        return frozenset(x.strip() for x in self.trusted_proxies.split(",") if x.strip())


@dataclass(frozen=True)
class KubeConfig:
    """[kube]: what `chipledger kube watch` reads as chips and teams (docs/kube.md)."""

    resources: str = "nvidia.com/gpu,amd.com/gpu,google.com/tpu"  # extended resources counted as chips, comma-separated
    team_label: str = ""  # a ClusterQueue label naming its team; "": the ClusterQueue's name (in a cohort: COHORT/name)

    def __post_init__(self):
        if not self.resource_list():
            raise ValueError("[kube] resources must name at least one resource, e.g. nvidia.com/gpu")

    def resource_list(self) -> tuple[str, ...]:
        return tuple(r.strip() for r in self.resources.split(",") if r.strip())


@dataclass(frozen=True)
class Config:
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    lake: LakeConfig = field(default_factory=LakeConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    statements: StatementsConfig = field(default_factory=StatementsConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    backtest: BacktestConfig = field(default_factory=BacktestConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    kube: KubeConfig = field(default_factory=KubeConfig)


_TYPES = {"int": int, "str": str, "bool": bool, "float": float}
_SECRETS = {("kafka", "password")}  # never echoed in an error message
# keys that moved: (section, key) -> where the value lives now
_MOVED = {("policy", "capacity_slo_target"): "[slo] availability (the capacity SLO's target: its error budget "
                                             "gates bursts)",
          ("worker", "merge_idle_ms"): "[worker] sequencer_wait_ms (the sequencer orders by the producers' "
                                       "headers, not by time: docs/streaming.md)"}
_SECTION_CLASSES = {"kafka": KafkaConfig, "store": StoreConfig, "lake": LakeConfig, "ledger": LedgerConfig,
                    "slo": SloConfig, "policy": PolicyConfig, "statements": StatementsConfig,
                    "worker": WorkerConfig, "backtest": BacktestConfig, "kube": KubeConfig,
                    "serve": ServeConfig}


def _coerce(section: str, key: str, value: Any, target: type, origin: str):
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
    elif target is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif target is str:
        if isinstance(value, str):
            return value
    elif target is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    shown = "a value of another type" if (section, key) in _SECRETS else repr(value)
    raise ConfigError(f"{origin}: [{section}] {key} must be a {target.__name__}, got {shown}")


def _replace_section(current, updates: dict, origin: str):
    try:
        return replace(current, **updates)
    except ValueError as err:  # a value of the right type but out of range (the section's own check)
        raise ConfigError(f"{origin}: {err}") from None


def load_config(path: Optional[Path] = None, env: Optional[Mapping[str, str]] = None) -> Config:
    """Read the TOML file (if given; `chipledger.toml` in the working directory if present), then apply
    environment overrides. Unknown sections or keys are an error, so a typo never passes silently."""
    env = os.environ if env is None else env
    data: dict[str, dict] = {}
    if path is None and Path("chipledger.toml").is_file():
        path = Path("chipledger.toml")
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    cfg = Config()
    for section, values in data.items():
        cls = _SECTION_CLASSES.get(section)
        if cls is None or not isinstance(values, dict):
            raise ConfigError(f"{path}: unknown section [{section}] (known: {', '.join(_SECTION_CLASSES)})")
        types = {f.name: f.type for f in fields(cls)}
        updates = {}
        for key, value in values.items():
            if (section, key) in _MOVED:
                raise ConfigError(f"{path}: [{section}] {key} is now {_MOVED[section, key]}")
            if key not in types:
                raise ConfigError(f"{path}: unknown key {key!r} in [{section}] (known: {', '.join(types)})")
            updates[key] = _coerce(section, key, value, _TYPES[types[key]], str(path))
        cfg = replace(cfg, **{section: _replace_section(getattr(cfg, section), updates, str(path))})
    for (section, key), now in _MOVED.items():
        name = f"CHIPLEDGER_{section.upper()}_{key.upper()}"
        if name in env:
            raise ConfigError(f"{name}: [{section}] {key} is now {now}")
    for section, cls in _SECTION_CLASSES.items():
        types = {f.name: f.type for f in fields(cls)}
        updates = {}
        for key, typ in types.items():
            name = f"CHIPLEDGER_{section.upper()}_{key.upper()}"
            if name in env:
                updates[key] = _coerce(section, key, env[name], _TYPES[typ], name)
        if updates:
            origin = ", ".join(f"CHIPLEDGER_{section.upper()}_{k.upper()}" for k in updates)
            cfg = replace(cfg, **{section: _replace_section(getattr(cfg, section), updates, origin)})
    return cfg
