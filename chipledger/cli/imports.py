"""`chipledger import alibaba-openb|helios|sacct`: real traces and scheduler logs into event JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.markup import escape

from chipledger.cli._common import JsonOpt, OutOpt, _fail, _os_error, app, console
from chipledger.cli.run import _add_breakdown, _counts_table


import_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Turn real traces and scheduler logs into event JSONL.")


app.add_typer(import_app, name="import")


def _import(fmt: str, src: Path, out: Path, as_json: bool, **options) -> None:
    from chipledger.adapters.importers.base import TraceFormatError
    from chipledger.adapters.importers.registry import import_trace

    if not src.exists():
        _fail(f"{src} does not exist")
    try:
        report = import_trace(fmt, src, out, **options)
    except (TraceFormatError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot import into {out}: {_os_error(e)}")
    if as_json:
        console.file.write(json.dumps(report.as_dict()) + "\n")
        return
    t = _counts_table(f"import {fmt} {src}")
    t.add_row("rows read", f"{report.rows_read:,}")
    _add_breakdown(t, "events written", report.events)
    _add_breakdown(t, "rows skipped", report.skipped)
    t.add_row("pools", ", ".join(report.pools))
    t.add_row("time span", f"{report.first_at} … {report.last_at}")
    from chipledger.reports.tables import print_table

    print_table(t, console)
    for note in report.notes:
        console.print(f"note: {escape(str(note))}")
    console.print(f"events: {out}  (fold them: chipledger run --events {out})")


@import_app.command("alibaba-openb")
def import_alibaba(src: Path = typer.Argument(..., help="folder with openb_node_list_gpu_node.csv and "
                                                         "openb_pod_list_default.csv"),
                   out: Path = OutOpt,
                   start: Optional[str] = typer.Option(None, help="UTC instant that trace second 0 maps to "
                                                                   "(default 2023-01-01T00:00:00Z)"),
                   as_json: bool = JsonOpt):
    """The Alibaba GPU cluster trace v2023 (openb): GPU nodes → pools and chips, pods → jobs."""
    options = {}
    if start is not None:
        from datetime import datetime

        try:
            options["start"] = datetime.fromisoformat(start.replace("Z", "+00:00"))
        except ValueError:
            _fail(f"--start {start!r} is not an ISO 8601 time", 2)
    _import("alibaba-openb", src, out, as_json, **options)


@import_app.command("helios")
def import_helios_cmd(src: Path = typer.Argument(..., help="folder with cluster_gpu_number.csv "
                                                            "(and cluster_log.csv when present)"),
                      out: Path = OutOpt,
                      cluster: Optional[str] = typer.Option(None, help="cluster name (default: the folder name)"),
                      tz: str = typer.Option("UTC", help="time zone of the trace's times and quota days"),
                      as_json: bool = JsonOpt):
    """Helios (SenseTime) quota files → time-bounded grants per virtual cluster, job logs → jobs."""
    _import("helios", src, out, as_json, tz=tz, **({"cluster": cluster} if cluster else {}))


@import_app.command("sacct")
def import_sacct_cmd(src: Path = typer.Argument(..., help="output of sacct --parsable2"),
                     out: Path = OutOpt,
                     tz: str = typer.Option("UTC", help="time zone of the sacct timestamps"),
                     chips_per_node: int = typer.Option(8, help="GPUs per node in the partitions"),
                     cluster: Optional[str] = typer.Option(None, help="pools <cluster>/<partition>, as `slurm "
                                                           "watch` names them"),
                     nodes: Optional[Path] = typer.Option(None, help="`sinfo --json` or `scontrol show node -o` dump: the chips (needs "
                                                         "--cluster)"),
                     assoc: Optional[Path] = typer.Option(None, help="`sacctmgr -P show assoc format=id,account,user,"
                                                          "partition,grptres[,parentname]` dump: GPU quotas (needs --nodes); with "
                                                          "parentname, teams named org/team by the account hierarchy"),
                     inventory_at: Optional[str] = typer.Option(None, help="when the chips and quotas take effect "
                                                                "(ISO 8601 or epoch; default the first Submit)"),
                     node_events: Optional[Path] = typer.Option(None, help="`sacctmgr -n -P show event event=node "
                                                                "format=nodename,start,end,state,reason` dump: "
                                                                "down/drain periods (needs --nodes)"),
                     reservations: Optional[Path] = typer.Option(None, help="`sacctmgr -n -P show reservation "
                                                                 "format=name,nodenames,start,end,flags` dump: "
                                                                 "maintenance periods (needs --nodes)"),
                     as_json: bool = JsonOpt):
    """Slurm accounting (sacct -D --parsable2): Account → team, Partition → pool, GPU TRES → chips."""
    at = None
    if inventory_at is not None:
        from chipledger.adapters.slurm.watch import WatchError, parse_since

        try:
            at = parse_since(inventory_at, cluster or "")
        except WatchError as e:
            _fail(str(e).replace("--since", "--inventory-at"), 2)
    _import("sacct", src, out, as_json, tz=tz, chips_per_node=chips_per_node, cluster=cluster, nodes=nodes,
            assoc=assoc, inventory_at=at, node_events=node_events, reservations=reservations)
