"""Launching: local clusters (forked from a zygote), multi-host rendezvous and the
virtual-time cluster. Starts servers and workers; imports the worker side and the core."""
