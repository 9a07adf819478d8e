#!/usr/bin/env bash
# Prometheus, promtool and Alertmanager for the monitoring tests (tests/prom_support.py starts its own
# throwaway servers from these binaries, on 127.0.0.1, free ports, temp storage).
#
#   bash scripts/prometheus.sh ensure   install Debian's `prometheus` (prometheus + promtool) and
#                                       `prometheus-alertmanager` packages when a binary is missing
#                                       (only as root with apt-get; otherwise say loudly what to install)
#   bash scripts/prometheus.sh check    exit 0 when prometheus, promtool and Alertmanager are on PATH
#
# Debian names Alertmanager's binary `prometheus-alertmanager`; upstream's tarball names it `alertmanager`:
# either will do (tests/prom_support.py looks for both).
#
# `ensure` always exits 0: whether a missing tool is a skip or a failure is the tests' decision
# (CHIPLEDGER_REQUIRE_PROMETHEUS=1 makes it a failure). It leaves no server of the packages running: where
# systemd started the packaged services on install, they are stopped and disabled (the tests start their own).
set -uo pipefail

missing() {
    local t out=()
    for t in prometheus promtool; do command -v "$t" >/dev/null 2>&1 || out+=("$t"); done
    command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 \
        || out+=("alertmanager")
    echo "${out[*]:-}"
}

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # loud

quiesce() {
    if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
        local unit
        for unit in prometheus prometheus-alertmanager prometheus-node-exporter; do
            systemctl stop "$unit" >/dev/null 2>&1 || true
            systemctl disable "$unit" >/dev/null 2>&1 || true
        done
    fi
}

case "${1:-}" in
    check)
        [[ -z "$(missing)" ]]
        ;;
    ensure)
        gone=$(missing)
        if [[ -z "$gone" ]]; then
            exit 0
        fi
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
            echo "scripts/prometheus.sh: installing prometheus and prometheus-alertmanager (missing: $gone)" >&2
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -q >/dev/null 2>&1 || apt-get update -q
            # policy-rc.d 101: the packages' post-install scripts start no service (where there is no systemd)
            if [[ ! -e /usr/sbin/policy-rc.d ]]; then
                printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
                trap 'rm -f /usr/sbin/policy-rc.d' EXIT
            fi
            apt-get install -y -q --no-install-recommends prometheus prometheus-alertmanager >/dev/null \
                || apt-get install -y --no-install-recommends prometheus prometheus-alertmanager
            quiesce
        fi
        gone=$(missing)
        if [[ -n "$gone" ]]; then
            loud "scripts/prometheus.sh: $gone not found and could not be installed here." \
                 "Install Debian's prometheus and prometheus-alertmanager packages (or put the binaries on PATH);" \
                 "the monitoring tests are skipped without them (they fail with CHIPLEDGER_REQUIRE_PROMETHEUS=1)."
        fi
        exit 0
        ;;
    *)
        echo "usage: $0 ensure|check" >&2
        exit 2
        ;;
esac
