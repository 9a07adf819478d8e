"""What the lake says, for people: the SLO report and its charts, quota statements and their templates, and
`why` / `pending` (a job's reason and the queue). Reads the lake through analytics' views; writes no books."""
