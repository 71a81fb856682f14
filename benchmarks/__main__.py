"""``python -m benchmarks [OPTIONS]``: the same command as ``paramserver bench``."""

from __future__ import annotations

from cli.bench import bench

if __name__ == "__main__":
    bench(prog_name="python -m benchmarks")
