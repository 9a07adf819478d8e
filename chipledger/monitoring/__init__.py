"""Monitoring: `/metrics` for an embedded lake (`server`), the Prometheus recording and burn-rate rules
(`slo_rules`), the Grafana dashboard (`grafana`), the Alertmanager client (`alertmanager`) and the CLI's
burn-rate alerts (`alerts`)."""
