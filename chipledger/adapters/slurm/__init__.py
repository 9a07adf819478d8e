"""The live Slurm adapter: `slurm watch` (watch.py) turns a cluster into events, `slurm actuate` (actuate.py)
applies the ledger's preemptions to it; mapping.py is the pure mapping shared with `import sacct`, commands.py the
only place Slurm's commands run. docs/slurm.md is the admin's guide."""
