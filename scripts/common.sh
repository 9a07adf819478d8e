# What the scripts that install a test service's packages share (sourced by scripts/*.sh, not run).

# loud LINE...: a framed message on stderr, for what a developer must not miss (a service the tests will skip)
loud() {
    {
        echo "################################################################################"
        local line
        for line in "$@"; do echo "## $line"; done
        echo "################################################################################"
    } >&2
}
