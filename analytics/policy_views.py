"""DuckDB views of the policy layer (fair share, decisions, why pending): `decisions`, `decision_victims`,
`balances`, `balances_org`, `pending`, `pending_history`. Kept apart from analytics/views.py so the policy
views and the SLO views evolve independently; `analytics.views.connect` defines these after its own views, so
they may use them.

The raw tables of the policy layer are exposed under other names (`POLICY_RAW_VIEW_NAMES`) so the views with
the users' names can add columns: the lake keeps integers, the core's fair-share factor and the decision JSON, the views derive ratios,
chips and the fields of the JSON. Definitions in docs/policy.md and docs/analytics.md.
"""

from __future__ import annotations

# lake table -> name of its raw view
POLICY_RAW_VIEW_NAMES = {"decisions": "decision_log", "balances": "balance_log", "pending": "pending_log"}

POLICY_VIEWS: dict[str, str] = {
    # every decision, with the fields of its type taken from the decision JSON
    "decisions": """
        SELECT decision_id, type, pool, "at", rule, message,
               coalesce(body->>'$.beneficiary.team', body->>'$.team') AS team,
               body->>'$.beneficiary.job_id' AS beneficiary_job_id,
               CASE WHEN type = 'decision.preempt' THEN json_array_length(body->'$.victims') END AS victims,
               TRY_CAST(body->>'$.numbers.need_chips' AS DOUBLE) AS need_chips,
               TRY_CAST(body->>'$.numbers.freed_chips' AS DOUBLE) AS freed_chips,
               TRY_CAST(body->>'$.numbers.lost_work_chip_s' AS BIGINT) AS lost_work_chip_s,
               body->>'$.request_id' AS request_id, body->>'$.verdict' AS verdict,
               TRY_CAST(body->>'$.numbers.requested_chips' AS DOUBLE) AS requested_chips,
               TRY_CAST(body->>'$.chips_granted' AS DOUBLE) AS chips_granted,
               TRY_CAST(body->>'$.window_start' AS TIMESTAMPTZ) AS window_start,
               TRY_CAST(body->>'$.window_end' AS TIMESTAMPTZ) AS window_end,
               TRY_CAST(body->>'$.checkpoint_by' AS TIMESTAMPTZ) AS checkpoint_by,
               body
        FROM decision_log
    """,
    # one row per victim of a preemption decision, and when (if) the cluster preempted it for that decision
    "decision_victims": """
        WITH vs AS (
            SELECT d.decision_id, d.pool, d."at", TRY_CAST(d.body->>'$.checkpoint_by' AS TIMESTAMPTZ) AS checkpoint_by,
                   unnest(json_extract(d.body, '$.victims[*]')) AS v
            FROM decision_log d WHERE d.type = 'decision.preempt'
        ), acted AS (
            SELECT pool, job_id, body->>'$.decision_id' AS decision_id, min(applied_at) AS preempted_at
            FROM events WHERE type = 'job.preempted' AND body->>'$.decision_id' IS NOT NULL
            GROUP BY ALL
        )
        SELECT vs.decision_id, vs.pool, vs."at", vs.v->>'job_id' AS job_id, vs.v->>'team' AS team,
               (vs.v->>'chips')::DOUBLE AS chips, (vs.v->>'lost_work_chip_s')::BIGINT AS lost_work_chip_s,
               (vs.v->>'preemption_count')::INTEGER AS preemption_count, vs.checkpoint_by, acted.preempted_at
        FROM vs LEFT JOIN acted ON acted.pool = vs.pool AND acted.job_id = vs.v->>'job_id'
                               AND acted.decision_id = vs.decision_id
    """,
    # each team's balance at each close of an hour (and at the end of the run): chips now, decayed usage, and
    # the fair-share factor F = 2^(-(U/ΣU)/S) the core computed at that instant (ledger.policy.fair_share_factor)
    "balances": """
        SELECT DISTINCT pool, team, "at", nominal_milli / 1000.0 AS nominal_chips, used_milli / 1000.0 AS used_chips,
               borrowed_milli / 1000.0 AS borrowed_chips, burst_milli / 1000.0 AS burst_chips,
               pending_milli / 1000.0 AS pending_chips, decayed_usage_mchip_s, fair_share_factor,
               CASE WHEN lendable_milli > 0 THEN borrowed_milli / lendable_milli ELSE 0.0 END AS borrowed_share,
               lendable_milli / 1000.0 AS lendable_chips
        FROM balance_log
    """,
    # org totals: team names that are paths (`org/team`) summed by their first part, per pool and across pools
    # (pool NULL)
    "balances_org": """
        SELECT pool, CASE WHEN strpos(team, '/') > 0 THEN split_part(team, '/', 1) ELSE team END AS org, "at",
               sum(nominal_chips) AS nominal_chips, sum(used_chips) AS used_chips,
               sum(borrowed_chips) AS borrowed_chips, sum(burst_chips) AS burst_chips,
               sum(pending_chips) AS pending_chips, sum(decayed_usage_mchip_s)::BIGINT AS decayed_usage_mchip_s,
               count(*) AS teams
        FROM balances
        GROUP BY GROUPING SETS ((pool, org, "at"), (org, "at"))
    """,
    # every reason recorded for a pending job (at each close of an hour and at the end of the run)
    "pending_history": """
        SELECT DISTINCT pool, job_id, team, "at", chips_milli / 1000.0 AS chips, priority, waiting_since,
               date_diff('second', waiting_since, "at") AS waited_s, reason, message
        FROM pending_log
    """,
    # the jobs pending at the latest instant of each pool's balances, with their current reason
    "pending": """
        SELECT p.* FROM pending_history p
        JOIN (SELECT pool, max("at") AS "at" FROM balance_log GROUP BY pool) latest USING (pool, "at")
    """,
}
