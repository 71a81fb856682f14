"""The shard's rules as a pure state machine: versions, clocks, modes, rounds,
exactly-once, the optimizer step, snapshots and the plan. No I/O, no clock of its
own (time is an argument), no sockets: import-linter forbids them here.
"""
