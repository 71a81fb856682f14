"""The shard server process: the event loop around the core, peers and their
access, outgoing replies, multi-part messages, checkpointing and its config.
"""
