"""What workers report about where their time goes: trace.py, the Chrome-trace recorder whose
per-category totals feed the server's busy-time metrics."""
