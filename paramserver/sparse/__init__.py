"""Sparse embedding tables on a shard: the rows a shard owns and their storage.
Pure like the core; the consistency rules they follow live in the core.
"""
