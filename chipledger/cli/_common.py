"""What every command group shares: the typer app and its groups, the consoles, the config and lake options, one-line errors."""

from __future__ import annotations

import time

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.markup import escape

from chipledger.config import Config, ConfigError, LakeConfig, load_config

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=True,
                  help="chipledger: an event-sourced quota and demand ledger for shared accelerator fleets.")
schema_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The event contract as JSON Schema.")
app.add_typer(schema_app, name="schema")
kafka_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="A local single-node Apache Kafka (KRaft) from Maven Central jars, for development.")
app.add_typer(kafka_app, name="kafka")
topics_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The chipledger Kafka topics (inputs keyed by pool, outputs).")
app.add_typer(topics_app, name="topics")
lake_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Maintenance of the lake's Parquet files.")
app.add_typer(lake_app, name="lake")
log_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                      help="The sequenced log (chipledger.log): the one order the fold reads.")
app.add_typer(log_app, name="log")
slo_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The SLOs for Prometheus: rules over /metrics.")
app.add_typer(slo_app, name="slo")
grafana_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="A Grafana dashboard over /metrics.")
app.add_typer(grafana_app, name="grafana")

from chipledger.reports.tables import CliConsole  # noqa: E402 - wide in a pipe: lines and tables never folded

console = CliConsole()
err = CliConsole(stderr=True)

PROGRESS_MIN_BYTES = 8 << 20  # show a progress bar for files larger than this
DEMO_LAKE = Path("demo") / "lake"  # where `make demo` (chipledger demo) writes its lake


@contextmanager
def _working(what: str):
    """A spinner with `what` on stderr while a long command works, on a terminal only: nothing is written to a pipe
    or a log file (no escape codes there), and the spinner is gone when the work is done (issue 35, item 12)."""
    if not err.is_terminal:
        yield
        return
    with err.status(what, spinner="dots"):
        yield


def _demo_lake(lake: Optional[Path], config: Optional[Path]) -> Optional[Path]:
    """The lake a reading command reads when no --lake is given: after `make demo`, with no ./lake and no [lake]
    path of one's own, `make demo`'s demo/lake, said in one line on stderr, so the command a newcomer types next
    works (issue 35, item 10). Otherwise `lake` as given (None: [lake] path, as before). A config that cannot be
    read is left for the command to report."""
    if lake is not None or not DEMO_LAKE.is_dir():
        return lake
    try:
        cfg = load_config(config)
    except ConfigError:
        return lake
    if cfg.lake.path != LakeConfig.path or Path(cfg.lake.path).exists():
        return lake
    err.print(f"(reading the demo's lake {DEMO_LAKE}: there is no ./{cfg.lake.path}; --lake or [lake] path "
              f"chooses another)", highlight=False, markup=False, soft_wrap=True)
    return DEMO_LAKE

ConfigOpt = typer.Option(None, "--config", help="chipledger.toml (default: ./chipledger.toml if present)",
                         exists=False, dir_okay=False)


def _print_version(value: bool) -> None:
    if value:
        from chipledger import __version__

        typer.echo(f"chipledger {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print the version and exit"),
):
    """chipledger: an event-sourced quota and demand ledger for shared accelerator fleets."""


def _config(path: Optional[Path]) -> Config:
    try:
        return load_config(path)
    except ConfigError as e:
        _fail(str(e), 2)


def _fail(message: str, code: int = 1):
    err.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _log(message: str) -> None:
    """A line on stderr stamped with the UTC time: the adapters' long-running commands (watch, actuate)."""
    err.print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {escape(message)}", highlight=False,
              soft_wrap=True)


def _os_error(e: OSError) -> str:
    """An OSError as one line: the path, then what the system said (no traceback)."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


def _lake_error(lake: Path, e: Exception) -> str:
    from analytics.views import duckdb_error_line

    line, out_of_memory = duckdb_error_line(e)
    if out_of_memory:
        return f"cannot read the lake {lake} within DuckDB's memory: {line}"
    return (f"cannot read the lake {lake}: {line} (a damaged Parquet file? restore it, or run the events again; "
            f"or [lake] spill_dir is not a folder DuckDB can write)")


def _lake_read(read, lake: Path):
    """`read()`, with a lake DuckDB cannot read (a truncated or damaged Parquet file, say) as one line of error
    instead of a traceback."""
    import duckdb

    from analytics.lake import LakeError

    try:
        return read()
    except duckdb.Error as e:
        _fail(_lake_error(lake, e))
    except LakeError as e:  # a lake of another layout, or missing a table: one line saying what to run
        _fail(str(e))


def _connect(lake: Path, **kwargs):
    """analytics.views.connect, with an unreadable lake as one line of error."""
    from analytics.views import connect

    return _lake_read(lambda: connect(lake, **kwargs), lake)


def _lake_dir(lake: Optional[Path], cfg: Config, code: int = 1) -> Path:
    """The lake a reader reads, checked (analytics.commits.open_lake): one line saying what to run, exit `code`,
    for a lake that is not there, of another layout, or missing a table or a committed file."""
    from analytics.commits import open_lake
    from analytics.lake import LakeError

    lake = lake or Path(cfg.lake.path)
    try:
        open_lake(lake)
    except LakeError as e:
        _fail(str(e), code)
    return lake


def _instant(text: Optional[str], option: str):
    if text is None:
        return None
    from chipledger.reports.report import parse_instant

    try:
        return parse_instant(text)
    except ValueError:
        _fail(f"{option} {text!r} is not an ISO 8601 date or time (e.g. 2026-11-02 or 2026-11-02T03:00:00Z)", 2)
PoolOpt = typer.Option(None, "--pool", help="only this pool (default: all pools)")
OutOpt = typer.Option(..., "-o", "--out", help="event JSONL to write")
JsonOpt = typer.Option(False, "--json", help="print the report as JSON")
DataDirOpt = typer.Option(Path(".kafka"), "--data-dir", help="broker config, data and log folder")
BootstrapOpt = typer.Option(None, "--bootstrap", metavar="HOST:PORT",
                            help="Kafka bootstrap servers (default [kafka] bootstrap / CHIPLEDGER_KAFKA_BOOTSTRAP)")
KafkaTimeoutOpt = typer.Option(10.0, "--timeout", min=0.1, help="seconds to wait for the broker to answer")
KafkaUserOpt = typer.Option(None, "--user", help="Kafka SASL/SCRAM user (default [kafka] username / "
                                                 "CHIPLEDGER_KAFKA_USERNAME)")
KafkaPasswordFileOpt = typer.Option(None, "--password-file", dir_okay=False,
                                    help="file whose first line is the user's password (default [kafka] "
                                         "password_file; or CHIPLEDGER_KAFKA_PASSWORD)")
KafkaCaFileOpt = typer.Option(None, "--ca-file", dir_okay=False,
                              help="CA certificate (PEM) the broker's TLS certificate is checked against; turns "
                                   "TLS on (default [kafka] ssl_cafile)")


def _kafka(cfg: Config, bootstrap: Optional[str], user: Optional[str] = None, password_file: Optional[Path] = None,
           ca_file: Optional[Path] = None):
    """The Kafka connection of a command: [kafka] config and environment, overridden by its options."""
    from streams.clients import KafkaSecurityError, connection_from_config

    try:
        return connection_from_config(cfg.kafka, bootstrap=bootstrap, username=user, password_file=password_file,
                                      ssl_cafile=ca_file)
    except KafkaSecurityError as e:
        _fail(str(e), 2)


def _write_text(text: str, out: Optional[Path]) -> None:
    if out is None:
        console.file.write(text)
        return
    try:
        out.write_text(text)
    except OSError as e:
        _fail(f"cannot write {out}: {e.strerror}")
    err.print(f"wrote {out}", highlight=False)


# -- shared by the live adapters' commands (`slurm`, `kube`): each passes its own `fail` (its consoles) -------------

def _adapter_kafka(cfg: Config, bootstrap: Optional[str], fail=None):
    """A watcher's or actuator's Kafka connection: [kafka] config and environment (address, and credentials where
    streams.clients provides them: the same as every chipledger producer), --bootstrap overriding the address."""
    fail = fail or _fail
    try:
        from streams.clients import connection_from_config
    except ImportError:  # a build without the authenticated clients: a PLAINTEXT address
        return bootstrap or cfg.kafka.bootstrap
    try:
        return connection_from_config(cfg.kafka, bootstrap=bootstrap)
    except Exception as e:  # noqa: BLE001 - KafkaSecurityError: a bad credentials setting, said plainly
        fail(str(e), 2)


def _watch_sink(emit: str, out_file: Optional[Path], jsonl_sink, kafka_sink, connection, fail=None):
    """A watcher's sink for --emit: `jsonl_sink(out_file)` (jsonl, which needs --out) or
    `kafka_sink(LedgerProducer(connection()))` (kafka); anything else fails (exit 2)."""
    fail = fail or _fail
    if emit == "jsonl":
        if out_file is None:
            fail("--emit jsonl needs --out FILE", 2)
        return jsonl_sink(out_file)
    if emit == "kafka":
        from streams.producer import LedgerProducer
        from streams.topics import KafkaSetupError

        try:
            return kafka_sink(LedgerProducer(connection()))
        except KafkaSetupError as e:
            fail(str(e), 2)
    fail(f"--emit {emit!r}: give jsonl or kafka", 2)


def _actuate(act, decisions: Optional[Path], lake: Optional[Path], from_kafka, errors: tuple, fail=None,
             keep: bool = False) -> tuple[dict, list]:
    """Applies each decision with the actuator `act`: from a JSONL file (`decisions`), else a lake's decisions table
    (`lake`), else `from_kafka()` ((decision, commit) pairs, each committed once applied). An error of `errors` fails
    the command (exit 1); Ctrl-C ends the reading. Returns the totals, and with `keep` the (outcome, decision)
    pairs."""
    from chipledger.adapters.slurm.actuate import decisions_from_jsonl, decisions_from_lake

    fail = fail or _fail
    totals = {"decisions": 0, "applied": 0, "gone": 0, "skipped": 0}
    outcomes: list = []

    def one(d: dict) -> None:
        o = act.apply(d)
        if keep:
            outcomes.append((o, d))
        totals["decisions"] += 1
        totals["applied"] += len(o.applied)
        totals["gone"] += len(o.gone)
        totals["skipped"] += bool(o.skipped)

    try:
        if decisions is not None:
            if not decisions.is_file():
                fail(f"{decisions} does not exist", 2)
            for d in decisions_from_jsonl(decisions):
                one(d)
        elif lake is not None:
            for d in decisions_from_lake(lake):
                one(d)
        else:
            for d, commit in from_kafka():
                one(d)
                commit()
    except errors as e:
        fail(str(e), 1)
    except KeyboardInterrupt:
        pass
    return totals, outcomes
