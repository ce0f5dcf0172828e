"""A hook for dqn_mp's processes (tests put it in a sitecustomize.py): a learner that takes 20 ms a
training step; after each, it notes how many messages it has taken and how many steps the play
process has played. The play process writes that number to $RL_TEST_AHEAD/played after every step,
the learner its notes to $RL_TEST_AHEAD/notes at exit."""

import atexit
import multiprocessing
import os
import time

import torch

import common
import runs

folder = os.environ["RL_TEST_AHEAD"]
_iter, _update, _step = (
    common.ExperienceSourceFirstLast.__iter__,
    runs.RewardTracker.update,
    torch.optim.Adam.step,
)
taken, notes = [0], []


def counting_iter(self):
    for count, exps in enumerate(_iter(self), 1):
        if multiprocessing.current_process().name == "play process":
            with open(os.path.join(folder, "played.new"), "w") as f:
                f.write(str(count))
            os.replace(os.path.join(folder, "played.new"), os.path.join(folder, "played"))
        yield exps


def counting_update(self, *args):
    taken[0] += 1
    return _update(self, *args)


def slow_step(self, *args, **kwargs):
    time.sleep(0.02)
    with open(os.path.join(folder, "played")) as f:
        notes.append((taken[0], int(f.read())))
    return _step(self, *args, **kwargs)


def write_notes():
    if notes:
        with open(os.path.join(folder, "notes"), "w") as f:
            f.write("\n".join(f"{t} {p}" for t, p in notes))


common.ExperienceSourceFirstLast.__iter__ = counting_iter
runs.RewardTracker.update, torch.optim.Adam.step = counting_update, slow_step
atexit.register(write_notes)
