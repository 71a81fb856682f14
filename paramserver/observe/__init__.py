"""What processes tell people: metrics, the divergence watchdog, JSONL event logs,
and the glue that feeds them from a shard or the launcher.
"""
