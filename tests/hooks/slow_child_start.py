"""A hook for a script's processes (tests put it in a sitecustomize.py): each spawned child, as its
interpreter starts and before it imports anything of the script, drops a file named by its pid in
$RL_TEST_STARTING and waits there for 5 seconds."""

import os
import sys
import time

if "spawn_main" in " ".join(sys.orig_argv):
    open(os.path.join(os.environ["RL_TEST_STARTING"], str(os.getpid())), "w").close()
    time.sleep(5)
