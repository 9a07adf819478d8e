"""The portal and read API (`chipledger serve`): app.py (routes, pages), lake.py (the warm DuckDB snapshot),
auth.py (tokens, proxy header, roles), burst.py (dry run over the core's rule), estimate.py (when a job starts).
docs/portal.md."""
