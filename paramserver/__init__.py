"""paramserver: sharded parameter servers for sync, async and bounded-staleness training."""

__version__ = "0.1.0"
