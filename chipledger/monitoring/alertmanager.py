"""A client of Alertmanager's API v2 (`POST /api/v2/alerts`): `chipledger alerts --alertmanager URL` sends the
burn-rate alerts firing in the lake (chipledger/monitoring/alerts.py) for users without Prometheus, with the labels and
annotations the Prometheus rules of `chipledger slo rules` give the same alerts (chipledger/monitoring/slo_rules.py).

An alert is posted without `endsAt`: Alertmanager keeps it firing for its `resolve_timeout` (5 minutes by
default) after the last post, so `chipledger alerts --alertmanager` run from cron more often than that keeps a
burning budget's alert up, and the alert resolves by itself once the budget stops burning.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterable

from chipledger.monitoring.slo_rules import ALERT_NAME, BUDGET_ALERT_NAME, _DESCRIBE, budget_annotations, runbook

#: what `look_at` tells (the lake's burn_alerts are per SLO, pool and team: the rules' labels)
_LOOK = {
    "availability": "chipledger report --pool {pool} (availability by day, error budgets)",
    "quota_honoured": "chipledger sql \"SELECT job_id, team, reason, message FROM pending WHERE pool = '{pool}'\" "
                      "then chipledger why JOB_ID; chipledger report --pool {pool}",
    "sched_latency": "chipledger sql \"SELECT job_id, team, reason, message FROM pending WHERE pool = '{pool}'\" "
                     "then chipledger why JOB_ID; chipledger report --pool {pool}",
    "goodput": "chipledger sql \"SELECT * FROM decisions WHERE pool = '{pool}'\"; chipledger report --pool {pool}",
    "throughput": "chipledger sql \"SELECT job_id, team, slow_s, unhealthy_chips_while_slow FROM throughput WHERE "
                  "pool = '{pool}' AND slow_s > 0\" then chipledger why JOB_ID; chipledger report --pool {pool}",
}


class AlertmanagerError(RuntimeError):
    pass


def payload(alerts: Iterable, generator_url: str = "", runbook_url: str = "") -> list[dict]:
    """The API v2 body for chipledger.monitoring.alerts.Alert values; `runbook_url`: the `[slo] runbook_url`
    template (the Prometheus rules' annotation of the same name)."""
    out = []
    for a in alerts:
        if a.slo == "budget":  # the labels and annotations of slo_rules' budget rule
            item = {"labels": {"alertname": BUDGET_ALERT_NAME, "severity": a.severity, "slo": "budget",
                               "alert": a.alert, "team": a.team, "unit": a.unit, "period": a.period,
                               "long_window": a.long_win, "short_window": a.short_win},
                    "annotations": budget_annotations(a.burn_rate, a.long_win, a.short_win, team=a.team, unit=a.unit),
                    "startsAt": a.evaluated_at.isoformat().replace("+00:00", "Z")}
            if generator_url:
                item["generatorURL"] = generator_url
            out.append(item)
            continue
        labels = {"alertname": ALERT_NAME, "severity": a.severity, "slo": a.slo, "pool": a.pool,
                  "alert": a.alert, "long_window": a.long_win, "short_window": a.short_win}
        team = getattr(a, "team", None)
        if team:
            labels["team"] = team
        who = f"pool {a.pool}" + (f" team {team}" if team else "")
        item = {
            "labels": labels,
            "annotations": {
                "summary": (f"{a.slo} error budget spent on {who}" if a.alert == "budget_exhausted" else
                            f"{a.slo} error budget burning at {a.burn_rate:g}x or more on {who}"),
                "description": (f"The {a.slo} SLO (target {100 * a.target:g}%) of {who} burns its error budget at "
                                f"{a.long_burn:.1f}x over {a.long_win} and {a.short_burn:.1f}x over {a.short_win} "
                                f"(threshold {a.burn_rate:g}x): {_DESCRIBE[a.slo]}."),
                "look_at": _LOOK[a.slo].format(pool=a.pool),
                **runbook(runbook_url, a.slo, a.alert),
            },
            "startsAt": a.evaluated_at.isoformat().replace("+00:00", "Z"),
        }
        if generator_url:
            item["generatorURL"] = generator_url
        out.append(item)
    return out


def send(url: str, alerts: list, timeout_s: float = 10.0, runbook_url: str = "") -> int:
    """POST the alerts to the Alertmanager at `url` (its base URL, e.g. http://127.0.0.1:9093); returns how many
    were sent. Raises AlertmanagerError with a sentence when it cannot be reached or refuses them."""
    if not alerts:
        return 0
    if not url.startswith(("http://", "https://")):
        raise AlertmanagerError(f"--alertmanager {url!r} is not an http:// or https:// URL")
    body = json.dumps(payload(alerts, runbook_url=runbook_url)).encode()
    req = urllib.request.Request(url.rstrip("/") + "/api/v2/alerts", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:300]
        raise AlertmanagerError(f"Alertmanager at {url} refused the alerts: HTTP {e.code} {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise AlertmanagerError(f"cannot reach Alertmanager at {url}: {reason}") from None
    return len(alerts)
