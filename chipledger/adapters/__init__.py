"""Adapters: a scheduler's or a trace's world turned into events, and the ledger's decisions applied back.

`slurm/` (a live Slurm: watch and actuate), `kube/` (Kubernetes with Kueue: watch and actuate), `importers/`
(public GPU-cluster traces and Slurm accounting files into event JSONL). Each maps its world in one module and
derives event ids from the scheduler's own ids, so reading twice sends nothing twice.
"""
