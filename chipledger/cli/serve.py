"""`chipledger serve` (the portal and read API, chipledger/web/) and `chipledger serve tokens create|list|revoke`."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from chipledger.cli._common import (DEMO_LAKE, ConfigOpt, KafkaCaFileOpt, KafkaPasswordFileOpt, KafkaUserOpt,
                                    _config, _demo_lake, _fail, _kafka, _lake_dir, app, console, err)

serve_app = typer.Typer(rich_markup_mode=None, invoke_without_command=True,
                        help="The portal and read API: pages for teams, admins and SREs, JSON under /api/v1.")
tokens_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="API tokens of the portal (stored hashed in the store).")
serve_app.add_typer(tokens_app, name="tokens")
app.add_typer(serve_app, name="serve")

StoreOpt = typer.Option(None, "--store", help="store URL (default [store] url)")


DEMO_STORE = DEMO_LAKE.parent / "chipledger.db"  # where `make demo` (chipledger demo) keeps its store


def _store_url(cfg, store: Optional[str]) -> str:
    """The store the portal and its tokens use: --store, else [store] url; after `make demo`, with neither given,
    no ./chipledger.db and the demo's store there, the demo's (said in one line), so that `serve tokens create` and
    `serve` on the demo lake need no options, as the other reading commands (chipledger.cli._common._demo_lake)."""
    from chipledger.config import StoreConfig

    if store is None and cfg.store.url == StoreConfig.url and not Path("chipledger.db").exists() \
            and DEMO_STORE.is_file():
        err.print(f"(using the demo's store {DEMO_STORE}: there is no ./chipledger.db; --store or [store] url "
                  f"chooses another)", highlight=False, markup=False, soft_wrap=True)
        return f"sqlite:///{DEMO_STORE}"
    return store or cfg.store.url


def _statements_dir(cfg, lake_path: Path) -> Path:
    """[statements] out; on the demo's lake, with no folder of one's own, the demo's statements beside it."""
    out = Path(cfg.statements.out)
    if lake_path == DEMO_LAKE and not out.exists() and (DEMO_LAKE.parent / "statements").is_dir():
        return DEMO_LAKE.parent / "statements"
    return out


def _open_store(cfg, store: Optional[str]):
    from store.repo import StoreError, open_store

    try:
        return open_store(_store_url(cfg, store))
    except StoreError as e:
        _fail(str(e))


@serve_app.callback()
def serve(
    ctx: typer.Context,
    lake: Optional[Path] = typer.Option(None, "--lake", help="the lake (default [lake] path)"),
    store: Optional[str] = StoreOpt,
    bootstrap: Optional[str] = typer.Option(None, "--bootstrap", metavar="HOST:PORT",
                                            help="Kafka, to send burst requests (default: none, the burst form says "
                                                 "so; [serve] kafka = true uses [kafka] bootstrap)"),
    host: Optional[str] = typer.Option(None, "--host", help="address to listen on (default [serve] host, "
                                                             "127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="port (default [serve] port, 8470)"),
    statements_dir: Optional[Path] = typer.Option(None, "--statements", help="issued statements (default "
                                                                             "[statements] out)"),
    user: Optional[str] = KafkaUserOpt,
    password_file: Optional[Path] = KafkaPasswordFileOpt,
    ca_file: Optional[Path] = KafkaCaFileOpt,
    config: Optional[Path] = ConfigOpt,
):
    """Serve the portal. Reads need only the lake (and the store for tokens and statements); burst requests need
    Kafka (--bootstrap or [kafka] bootstrap): without it the burst form says so."""
    if ctx.invoked_subcommand is not None:
        return
    import uvicorn

    from chipledger.web.app import Portal, build_app, warm
    from chipledger.web.lake import LakeReader

    cfg = _config(config)
    lake_path = _lake_dir(_demo_lake(lake, config), cfg)
    st = _open_store(cfg, store)
    producer_factory = None
    if bootstrap or cfg.serve.kafka:
        conn = _kafka(cfg, bootstrap, user, password_file, ca_file)

        def producer_factory():
            from streams.producer import LedgerProducer

            # the portal sends burst.requested as its own principal (DESIGN §3): the connection of --user (its
            # signing key `<user>.key` beside --password-file, or [kafka] signing_key_file) signs every record
            return LedgerProducer(conn)
    # the warm step given here, before the first build: the first snapshot is warmed like every later one (its queue
    # estimates computed before it serves, not by the first request that reads the queue)
    reader = LakeReader(lake_path, refresh_s=cfg.serve.refresh_s, slo=cfg.slo, duckdb_config=cfg.lake.duckdb_config(),
                        warm=warm)
    try:
        reader.refresh(force=True)
    except Exception as e:
        _fail(f"cannot read the lake {lake_path}: {str(e).splitlines()[0]}")
    reader.start()
    portal = Portal(cfg=cfg, reader=reader, store=st, producer_factory=producer_factory,
                    statements_dir=statements_dir or _statements_dir(cfg, lake_path),
                    accuracy=_accuracy_note(lake_path))
    h = host or cfg.serve.host
    p = port or cfg.serve.port
    err.print(f"portal on http://{h}:{p}/ (lake {lake_path}, snapshot built in {reader.snapshot.build_s:.2f} s; "
              f"Kafka: {'yes' if producer_factory else 'no, burst requests disabled'})", highlight=False)
    uvicorn.run(build_app(portal), host=h, port=p, log_level="warning", proxy_headers=False)


def _accuracy_note(lake: Path) -> Optional[dict]:
    """The start estimate's accuracy, when measured for this lake (`portal-accuracy.json` beside it)."""
    import json

    path = lake.parent / "portal-accuracy.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None
    return None


@tokens_app.command("create")
def tokens_create(user: str = typer.Option(..., "--user", help="whose token"),
                  team: Optional[str] = typer.Option(None, "--team", help="the team it acts for (makes the user a "
                                                                           "member of it)"),
                  store: Optional[str] = StoreOpt, config: Optional[Path] = ConfigOpt):
    """Create a token; it is printed once (only its hash is stored)."""
    from chipledger.web.app import NAME_RE
    from chipledger.web.auth import new_token

    for what, v in (("--user", user), ("--team", team)):
        if v is not None and not NAME_RE.match(v):
            _fail(f"{what} {v!r} is not a valid name", 2)
    st = _open_store(_config(config), store)
    token_id, token = new_token(st, user, team)
    err.print(f"token {token_id} for {user}{f' (team {team})' if team else ''}; keep it, it is not shown again:",
              highlight=False)
    console.file.write(token + "\n")


@tokens_app.command("list")
def tokens_list(user: Optional[str] = typer.Option(None, "--user"), team: Optional[str] = typer.Option(None, "--team"),
                store: Optional[str] = StoreOpt, config: Optional[Path] = ConfigOpt):
    """The tokens (never their secrets)."""
    st = _open_store(_config(config), store)
    t = Table("id", "user", "team", "created", "revoked")
    for r in st.tokens(user=user, team=team):
        t.add_row(r.token_id, r.user, r.team or "", f"{r.created_at:%Y-%m-%d %H:%M:%S}Z",
                  "" if r.revoked_at is None else f"{r.revoked_at:%Y-%m-%d %H:%M:%S}Z")
    console.print(t)


@tokens_app.command("revoke")
def tokens_revoke(token_id: str = typer.Argument(..., help="the token's id (tokens list)"),
                  store: Optional[str] = StoreOpt, config: Optional[Path] = ConfigOpt):
    """Revoke a token: refused from then on (a running portal stops accepting it within 2 s)."""
    st = _open_store(_config(config), store)
    if not st.revoke_token(token_id, datetime.now(timezone.utc)):
        _fail(f"no token {token_id!r} to revoke (unknown, or revoked already)")
    err.print(f"revoked {token_id}", highlight=False)
