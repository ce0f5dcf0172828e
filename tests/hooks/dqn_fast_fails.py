"""A hook for bench.py's processes (tests put it in a sitecustomize.py): dqn_fast.py, run as a
script, writes one error line as a script answers bad input and exits at once with code 2."""

import os
import sys

if sys.orig_argv[1:] and sys.orig_argv[1].endswith("dqn_fast.py"):  # as a script answers bad input
    print("dqn_fast.py: error: injected", file=sys.stderr, flush=True)
    os._exit(2)
