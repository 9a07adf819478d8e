"""Analytics over the lake: Parquet tables written by the runs and the sink, DuckDB views over them.

Only DuckDB's built-in extensions (json, parquet, icu, core_functions) are used; nothing is installed at run
time.
"""
