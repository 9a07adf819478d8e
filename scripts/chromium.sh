#!/usr/bin/env bash
# Chromium for the tests that open generated HTML pages in a real browser (tests/test_backtest.py).
#
#   bash scripts/chromium.sh ensure   install Debian's `chromium` package if no chromium is on PATH
#                                     (only as root with apt-get; otherwise say loudly what to install)
#
# `ensure` always exits 0: whether a missing browser is a skip or a failure is the tests' decision
# (CHIPLEDGER_REQUIRE_CHROMIUM=1 makes it a failure).
set -uo pipefail

have() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }

if [[ "${1:-}" != "ensure" ]]; then
    echo "usage: $0 ensure" >&2
    exit 2
fi
have && exit 0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
fi
have || {
    echo "################################################################################" >&2
    echo "## chromium not found: the page tests will skip (install Debian's chromium)" >&2
    echo "################################################################################" >&2
}
exit 0
