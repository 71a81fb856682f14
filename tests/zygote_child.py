"""A process forked by the zygote in tests/test_zygote.py (``-m tests.zygote_child``)."""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":
    what = sys.argv[1]
    print(f"name={__name__} argv={sys.argv[1:]} cwd={os.getcwd()} "
          f"env={os.environ.get('ZYGOTE_TEST')}", flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    if what == "exit":
        sys.exit(int(sys.argv[2]))
    if what == "raise":
        raise ValueError("boom")
    if what == "random":
        import numpy as np

        print(np.random.randint(1 << 62), flush=True)
    if what == "pause":
        signal.pause()  # until a signal ends it
