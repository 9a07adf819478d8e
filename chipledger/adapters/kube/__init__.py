"""The Kubernetes + Kueue adapter: `kube watch` (watch.py) turns a cluster into events through resumable watches,
`kube actuate` (actuate.py) applies the ledger's preemptions to Workloads through Kueue; mapping.py is the pure
mapping of objects to views and events. deploy/kube/rbac.yaml holds the least-privilege roles; docs/kube.md is the
platform engineer's guide."""
