"""A hook for a script's processes (tests put it in a sitecustomize.py): the play process, or worker
0, writes half of its 20th message, says so in $RL_TEST_STALLED (its pid), and stalls there:
whatever kills it then kills it in the middle of a message."""

import multiprocessing
import multiprocessing.connection
import os
import time

_send, sent = multiprocessing.connection.Connection._send, []


def stalling_send(self, buf, *args):
    if multiprocessing.current_process().name in ("play process", "worker 0") and len(buf) > 100:
        sent.append(len(buf))
        if len(sent) == 20:
            _send(self, buf[: len(buf) // 2], *args)
            with open(os.environ["RL_TEST_STALLED"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
    return _send(self, buf, *args)


multiprocessing.connection.Connection._send = stalling_send
