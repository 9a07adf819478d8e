"""streams/acl.py without a broker: each role's ACLs, and a user's roles read back from its ACLs."""

from __future__ import annotations

import pytest

from streams.acl import LOG_TOPIC, ROLES, _roles_of, role_acls


def grants(roles, user="u", app_id="chipledger-worker"):
    return {(a.resource_pattern.resource_type.name, a.resource_pattern.resource_name,
             a.resource_pattern.pattern_type.name, a.operation.name) for a in role_acls(roles, user, app_id)}


def test_each_role_may_write_only_its_topics():
    writes = {r: {n for t, n, _, op in grants([r]) if t == "TOPIC" and op in ("WRITE", "ALL")} for r in ROLES}
    assert writes["admin"] == {"chipledger.quota"}
    assert writes["cluster"] == {"chipledger.jobs", "chipledger.chips"}
    assert writes["sink"] == set() and writes["reader"] == set()
    assert writes["worker"] == {LOG_TOPIC, "chipledger.journal", "chipledger.decisions", "chipledger.deadletter",
                                "chipledger.quota", "chipledger-worker"}  # the last: its prefixed own topics
    assert ("TOPIC", "chipledger-worker", "PREFIXED", "ALL") in grants(["worker"])
    assert ("GROUP", "team-a", "PREFIXED", "READ") in grants(["reader"], "team-a")
    assert all(a.principal == "User:team-a" for a in role_acls(["reader"], "team-a"))


def test_roles_are_read_back_from_acls():
    for roles in (["admin"], ["cluster"], ["sink"], ["reader"], ["admin", "cluster"]):
        assert _roles_of(role_acls(roles, "u"), "u") == (tuple(roles), None)
    assert _roles_of(role_acls(["worker"], "w", "chipledger-worker-eu"), "w") == (("worker",), "chipledger-worker-eu")
    assert _roles_of([], "u") == ((), None)
    with pytest.raises(ValueError, match="unknown role"):
        role_acls(["root"], "u")
