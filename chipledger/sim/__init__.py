"""Simulation: the seeded scenario generator (`scenario`, the demo's and the benchmarks' events), the simulated
cluster that replays demand with the ledger core deciding (`simcluster`) and `chipledger backtest` over it."""
