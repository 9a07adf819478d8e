#!/usr/bin/env bash
# PostgreSQL server binaries for the store contract tests (tests/pg.py starts a throwaway cluster from them).
#
#   bash scripts/postgres.sh ensure   install Debian's `postgresql` package if no server binaries are present
#                                     (only as root with apt-get; otherwise say loudly what to install)
#   bash scripts/postgres.sh bindir   print the directory the tests would use (exit 1 when there is none)
#
# Binaries are looked up like tests/pg.py does: $CHIPLEDGER_PG_BIN if set, else the newest
# /usr/lib/postgresql/<ver>/bin, else the directory of `initdb` on PATH (Fedora, Homebrew).
# `ensure` always exits 0: whether a missing server is a skip or a failure is the tests' decision
# (CHIPLEDGER_REQUIRE_POSTGRES=1 makes it a failure). It never leaves a server of its own running: a cluster
# the package starts on install is stopped and set to manual start (our tests use their own cluster).
set -uo pipefail

has_server() {  # $1: a directory; true when it holds initdb, pg_ctl and postgres
    [[ -x "$1/initdb" && -x "$1/pg_ctl" && -x "$1/postgres" ]]
}

find_bindir() {
    if [[ -n "${CHIPLEDGER_PG_BIN:-}" ]]; then
        has_server "$CHIPLEDGER_PG_BIN" && { echo "$CHIPLEDGER_PG_BIN"; return 0; }
        return 1
    fi
    local d
    while read -r d; do
        [[ -n "$d" ]] && has_server "$d" && { echo "$d"; return 0; }
    done < <(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r)
    d=$(command -v initdb 2>/dev/null) && d=$(dirname "$d") && has_server "$d" && { echo "$d"; return 0; }
    return 1
}

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # loud

# Stop and set to manual start every cluster the package created and started, so nothing we did not start
# keeps listening on 5432 (and it does not come back at boot).
quiesce_clusters() {
    if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
        systemctl stop postgresql >/dev/null 2>&1 || true
        systemctl disable postgresql >/dev/null 2>&1 || true
    fi
    if command -v pg_lsclusters >/dev/null 2>&1; then
        local ver name port status _rest
        while read -r ver name port status _rest; do
            [[ "$ver" =~ ^[0-9]+$ ]] || continue
            if [[ "$status" == online* ]]; then
                pg_ctlcluster "$ver" "$name" stop -m fast >/dev/null 2>&1 || true
            fi
            [[ -f "/etc/postgresql/$ver/$name/start.conf" ]] && echo manual >"/etc/postgresql/$ver/$name/start.conf"
        done < <(pg_lsclusters --no-header 2>/dev/null)
    elif command -v service >/dev/null 2>&1; then
        service postgresql stop >/dev/null 2>&1 || true
    fi
}

ensure() {
    if bindir=$(find_bindir); then
        return 0  # already installed: quiet
    fi
    if [[ -n "${CHIPLEDGER_PG_BIN:-}" ]]; then
        loud "CHIPLEDGER_PG_BIN=$CHIPLEDGER_PG_BIN has no initdb, pg_ctl and postgres." \
             "Not installing anything; the PostgreSQL store tests will be skipped" \
             "(or fail with CHIPLEDGER_REQUIRE_POSTGRES=1)."
        return 0
    fi
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "postgres.sh: installing the PostgreSQL server from Debian packages (apt-get install postgresql)..." >&2
        local t0=$SECONDS
        if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; then
            quiesce_clusters
            if bindir=$(find_bindir); then
                echo "postgres.sh: PostgreSQL server installed in $((SECONDS - t0))s: $bindir" >&2
                return 0
            fi
            loud "POSTGRESQL SERVER NOT FOUND after installing the postgresql package" \
                 "(no /usr/lib/postgresql/<ver>/bin/postgres). The PostgreSQL store tests will be skipped" \
                 "(or fail with CHIPLEDGER_REQUIRE_POSTGRES=1)."
        else
            quiesce_clusters
            loud "POSTGRESQL SERVER COULD NOT BE INSTALLED: apt-get install postgresql failed (see above)." \
                 "The PostgreSQL store tests will be skipped (or fail with CHIPLEDGER_REQUIRE_POSTGRES=1)."
        fi
        return 0
    fi
    loud "POSTGRESQL SERVER NOT INSTALLED: the PostgreSQL store tests will be skipped" \
         "(or fail with CHIPLEDGER_REQUIRE_POSTGRES=1). Install the server binaries, e.g." \
         "  Debian/Ubuntu:  sudo apt-get install postgresql" \
         "  Fedora:         sudo dnf install postgresql-server" \
         "  macOS:          brew install postgresql" \
         "or set CHIPLEDGER_PG_BIN to a directory holding initdb, pg_ctl and postgres." \
         "No server needs to be running: the tests start their own throwaway cluster."
    return 0
}

case "${1:-}" in
    ensure) ensure; exit 0 ;;
    bindir) find_bindir || exit 1 ;;
    *) echo "usage: $0 ensure|bindir" >&2; exit 2 ;;
esac
