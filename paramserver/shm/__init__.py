"""Same-host shared memory: workers' gradient segments and the shards' weight
boards, and the proof that a peer holds the segment it names.
"""
