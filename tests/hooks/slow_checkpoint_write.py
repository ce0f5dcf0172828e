"""A hook for a script's processes (tests put it in a sitecustomize.py): where $RL_SLOW_CHECKPOINT
is set, a checkpoint write leaves half a file at checkpoint.pt.tmp, prints "writing" and stalls for
60 s before it writes the checkpoint, so that a kill cuts it mid-write."""

import os
import time

import runs

save_whole = runs.save_whole


def slow_save_whole(obj, path):
    if path.endswith("checkpoint.pt") and os.environ.get("RL_SLOW_CHECKPOINT"):
        with open(path + ".tmp", "wb") as f:  # half a file, as a write that the kill cuts
            f.write(b"PK" * 1000)
        print("writing", flush=True)
        time.sleep(60)
    save_whole(obj, path)


runs.save_whole = slow_save_whole
