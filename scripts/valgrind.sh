#!/usr/bin/env bash
# valgrind, for bench/replay.py's instruction counts where `perf stat -e instructions` has no hardware counter
# (most virtual machines) and for the test of them (tests/test_bench_instructions.py).
#
#   bash scripts/valgrind.sh ensure   install Debian's `valgrind` when missing (only as root with apt-get;
#                                     otherwise say loudly what to install)
#
# `ensure` always exits 0: whether a missing valgrind is a skip or a failure is the test's decision
# (CHIPLEDGER_REQUIRE_VALGRIND=1 makes it a failure). It starts nothing.
set -uo pipefail

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"  # loud

ensure() {
    command -v valgrind >/dev/null 2>&1 && return 0  # already installed: quiet
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "valgrind.sh: installing valgrind from Debian packages..." >&2
        if apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends valgrind >/dev/null \
                && command -v valgrind >/dev/null 2>&1; then
            echo "valgrind.sh: installed $(valgrind --version)" >&2
            return 0
        fi
        loud "VALGRIND COULD NOT BE INSTALLED (apt-get install valgrind failed, see above)." \
             "The instruction count test will be skipped (or fail with CHIPLEDGER_REQUIRE_VALGRIND=1)."
        return 0
    fi
    loud "VALGRIND NOT INSTALLED: the instruction count test will be skipped" \
         "(or fail with CHIPLEDGER_REQUIRE_VALGRIND=1). Install it, e.g. sudo apt-get install valgrind"
    return 0
}

case "${1:-}" in
    ensure) ensure; exit 0 ;;
    *) echo "usage: $0 ensure" >&2; exit 2 ;;
esac
