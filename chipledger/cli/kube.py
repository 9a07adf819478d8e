"""`chipledger kube watch|actuate`: the command line of the Kubernetes adapter (wiring only; chipledger/adapters/kube/,
docs/kube.md)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from chipledger.cli._common import _fail, _log

kube_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                       help="A Kubernetes cluster with Kueue: watch it into events, apply the ledger's preemptions.")
err = Console(stderr=True)
out = Console()



def api_client(kubeconfig: Optional[Path], context: Optional[str]):
    """A client from a kubeconfig (default: $KUBECONFIG or ~/.kube/config), or the in-cluster ServiceAccount."""
    from kubernetes import client, config

    try:
        if kubeconfig is None and context is None:
            try:
                cfg = client.Configuration()
                config.load_kube_config(client_configuration=cfg)
            except config.ConfigException:
                cfg = client.Configuration()
                config.load_incluster_config(client_configuration=cfg)
        else:
            cfg = client.Configuration()
            config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None, context=context,
                                    client_configuration=cfg)
    except (config.ConfigException, OSError) as e:
        _fail(f"no usable kubeconfig ({e})", 2)
    return client.ApiClient(cfg)


def cluster_name(name: Optional[str], kubeconfig: Optional[Path], context: Optional[str]) -> str:
    """--cluster, else the kubeconfig context's cluster name (the `CLUSTER` of every pool `CLUSTER/flavor`)."""
    if name:
        return name
    from kubernetes import config

    try:
        _, active = config.list_kube_config_contexts(config_file=str(kubeconfig) if kubeconfig else None)
        if context:
            contexts, _ = config.list_kube_config_contexts(config_file=str(kubeconfig) if kubeconfig else None)
            active = next(c for c in contexts if c["name"] == context)
        return active["context"]["cluster"]
    except Exception:  # noqa: BLE001 - in-cluster, or no kubeconfig: the name must be given
        _fail("cannot tell the cluster's name from a kubeconfig: pass --cluster", 2)


KubeconfigOpt = typer.Option(None, "--kubeconfig", help="kubeconfig file (default $KUBECONFIG, ~/.kube/config, or "
                             "in-cluster)", dir_okay=False)
ContextOpt = typer.Option(None, "--context", help="kubeconfig context")
ClusterOpt = typer.Option(None, "--cluster", help="the CLUSTER of the pools CLUSTER/flavor (default: the context's "
                          "cluster)")
ConfigOpt = typer.Option(None, "--config", help="chipledger.toml (default: ./chipledger.toml if present)",
                         dir_okay=False)


def _config(config: Optional[Path]):
    from chipledger.config import ConfigError, load_config

    try:
        return load_config(config)
    except ConfigError as e:
        _fail(str(e), 2)


def _bootstrap(cfg, bootstrap: Optional[str]):
    from chipledger.cli._common import _adapter_kafka

    return _adapter_kafka(cfg, bootstrap, _fail)


@kube_app.command("watch")
def watch(
    kubeconfig: Optional[Path] = KubeconfigOpt,
    context: Optional[str] = ContextOpt,
    cluster: Optional[str] = ClusterOpt,
    state: Path = typer.Option(Path("kube-watch.state"), "--state", help="the watcher's cursor (JSON file)"),
    emit: str = typer.Option("jsonl", "--emit", help="jsonl (to --out) or kafka (to the input topics)"),
    out_file: Optional[Path] = typer.Option(None, "--out", help="JSONL file the events are appended to"),
    once: bool = typer.Option(False, "--once", help="list everything once, send what is due, save the cursor, exit"),
    interval: float = typer.Option(1.0, "--interval", help="seconds between flushes"),
    settle: int = typer.Option(5, "--settle", help="seconds an instant must be in the past before it is sent "
                               "(a condition's time can precede its write: Kueue copies a Job's finish time)"),
    tick: int = typer.Option(30, "--tick", help="seconds between the pools' pool.tick"),
    metrics_port: int = typer.Option(0, "--metrics-port", help="serve /metrics on 127.0.0.1:PORT (0: off)"),
    bootstrap: Optional[str] = typer.Option(None, "--bootstrap", help="Kafka bootstrap (default [kafka] bootstrap)"),
    config: Optional[Path] = ConfigOpt,
):
    """Follow Nodes, ResourceFlavors, ClusterQueues, LocalQueues and Workloads; send chips, pools, quotas and jobs.

    Ids derive from Kubernetes' own (uid and transition), and --state is the cursor: a restart or a relist sends
    nothing twice."""
    from chipledger.adapters.kube.watch import JsonlSink, KafkaSink, KubeApi, Watcher, WatchError, WatchMetrics
    from chipledger.cli._common import _watch_sink

    cfg = _config(config)
    name = cluster_name(cluster, kubeconfig, context)
    client = api_client(kubeconfig, context)
    sink = _watch_sink(emit, out_file, JsonlSink, KafkaSink, lambda: _bootstrap(cfg, bootstrap), _fail)
    metrics = WatchMetrics()
    if metrics_port:
        metrics.serve(metrics_port)
    try:
        watcher = Watcher(name, state, sink, KubeApi(client), resources=cfg.kube.resource_list(),
                          team_label=cfg.kube.team_label, settle_s=settle, tick_s=tick, log=_log, metrics=metrics)
    except WatchError as e:
        _fail(str(e), 2)
    stop = threading.Event()
    try:
        watcher.run(once=once, interval_s=interval, stop=stop)
    except KeyboardInterrupt:
        stop.set()
    except WatchError as e:
        _fail(str(e), 1)
    finally:
        sink.close()


@kube_app.command("actuate")
def actuate(
    kubeconfig: Optional[Path] = KubeconfigOpt,
    context: Optional[str] = ContextOpt,
    cluster: Optional[str] = ClusterOpt,
    state: Path = typer.Option(Path("kube-actuate.state"), "--state", help="decision ids applied (JSON file)"),
    decisions: Optional[Path] = typer.Option(None, "--decisions", help="JSONL file of decisions"),
    lake: Optional[Path] = typer.Option(None, "--lake", help="read decisions from a lake (embedded runs)"),
    kafka: bool = typer.Option(False, "--kafka", help="consume chipledger.decisions"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be done, change nothing"),
    follow: bool = typer.Option(False, "--follow", help="with --kafka: keep consuming"),
    metrics_port: int = typer.Option(0, "--metrics-port", help="serve /metrics on 127.0.0.1:PORT (0: off)"),
    bootstrap: Optional[str] = typer.Option(None, "--bootstrap", help="Kafka bootstrap (default [kafka] bootstrap)"),
    config: Optional[Path] = ConfigOpt,
):
    """Evict each decision.preempt's victim Workloads through Kueue (requeued by Kueue), once per decision id."""
    from chipledger.adapters.kube.actuate import ActuateError, ActuateMetrics, Actuator, KubeOps, decisions_from_kafka
    from chipledger.adapters.slurm.actuate import ActuateError as SlurmActuateError
    from chipledger.cli._common import _actuate

    if sum(x is not None and x is not False for x in (decisions, lake, kafka or None)) != 1:
        _fail("give exactly one of --decisions FILE, --lake DIR, --kafka", 2)
    cfg = _config(config)
    name = cluster_name(cluster, kubeconfig, context)
    metrics = ActuateMetrics()
    if metrics_port:
        metrics.serve(metrics_port)
    try:
        act = Actuator(name, state, KubeOps(api_client(kubeconfig, context)), dry_run=dry_run, log=_log,
                       metrics=metrics)
    except ActuateError as e:
        _fail(str(e), 2)
    totals, _ = _actuate(act, decisions, lake,
                         lambda: decisions_from_kafka(_bootstrap(cfg, bootstrap), name, follow=follow,
                                                      group=f"chipledger-kube-actuate-{name}"),
                         # the decision readers are the Slurm adapter's: their errors are one line too
                         (ActuateError, SlurmActuateError), _fail)
    out.print(" ".join(f"{k} {v}" for k, v in totals.items()) + (" (dry run)" if dry_run else ""), highlight=False)
