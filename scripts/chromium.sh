#!/usr/bin/env bash
# Headless Chromium and its WebDriver for the tests that open chipledger's HTML pages in a browser
# (tests/browser.py starts one browser per test session through selenium).
#
#   bash scripts/chromium.sh ensure   install Debian's `chromium` and `chromium-driver` when either is missing
#                                     (only as root with apt-get; otherwise say loudly what to install)
#   bash scripts/chromium.sh paths    print the browser and the driver the tests would use (exit 1: none)
#
# Looked up like tests/browser.py does: $CHIPLEDGER_CHROMIUM / $CHIPLEDGER_CHROMEDRIVER if set, else
# chromium (or chromium-browser, google-chrome) and chromedriver on PATH.
# `ensure` always exits 0: whether a missing browser is a skip or a failure is the tests' decision
# (CHIPLEDGER_REQUIRE_CHROMIUM=1 makes it a failure). It starts nothing.
set -uo pipefail

find_browser() {
    if [[ -n "${CHIPLEDGER_CHROMIUM:-}" ]]; then
        [[ -x "$CHIPLEDGER_CHROMIUM" ]] && { echo "$CHIPLEDGER_CHROMIUM"; return 0; }
        return 1
    fi
    local b
    for b in chromium chromium-browser google-chrome; do
        command -v "$b" 2>/dev/null && return 0
    done
    return 1
}

find_driver() {
    if [[ -n "${CHIPLEDGER_CHROMEDRIVER:-}" ]]; then
        [[ -x "$CHIPLEDGER_CHROMEDRIVER" ]] && { echo "$CHIPLEDGER_CHROMEDRIVER"; return 0; }
        return 1
    fi
    command -v chromedriver 2>/dev/null
}

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # loud

ensure() {
    if find_browser >/dev/null && find_driver >/dev/null; then
        return 0  # already installed: quiet
    fi
    if [[ -n "${CHIPLEDGER_CHROMIUM:-}${CHIPLEDGER_CHROMEDRIVER:-}" ]]; then
        loud "CHIPLEDGER_CHROMIUM / CHIPLEDGER_CHROMEDRIVER point at no executable." \
             "Not installing anything; the browser tests will be skipped" \
             "(or fail with CHIPLEDGER_REQUIRE_CHROMIUM=1)."
        return 0
    fi
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "chromium.sh: installing chromium and chromium-driver from Debian packages..." >&2
        local t0=$SECONDS
        if apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; then
            if find_browser >/dev/null && find_driver >/dev/null; then
                echo "chromium.sh: installed in $((SECONDS - t0))s: $(find_browser), $(find_driver)" >&2
                return 0
            fi
            loud "CHROMIUM NOT FOUND after installing chromium and chromium-driver." \
                 "The browser tests will be skipped (or fail with CHIPLEDGER_REQUIRE_CHROMIUM=1)."
        else
            loud "CHROMIUM COULD NOT BE INSTALLED: apt-get install chromium chromium-driver failed (see above)." \
                 "The browser tests will be skipped (or fail with CHIPLEDGER_REQUIRE_CHROMIUM=1)."
        fi
        return 0
    fi
    loud "CHROMIUM NOT INSTALLED: the browser tests (HTML pages opened in headless Chromium) will be skipped" \
         "(or fail with CHIPLEDGER_REQUIRE_CHROMIUM=1). Install a browser and its WebDriver, e.g." \
         "  Debian/Ubuntu:  sudo apt-get install chromium chromium-driver" \
         "  Fedora:         sudo dnf install chromium chromedriver" \
         "or set CHIPLEDGER_CHROMIUM and CHIPLEDGER_CHROMEDRIVER to their executables."
    return 0
}

case "${1:-}" in
    ensure) ensure; exit 0 ;;
    paths) b=$(find_browser) && d=$(find_driver) || exit 1; echo "$b"; echo "$d" ;;
    *) echo "usage: $0 ensure|paths" >&2; exit 2 ;;
esac
