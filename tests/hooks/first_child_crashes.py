"""A hook for a script's processes (tests put it in a sitecustomize.py): the play process, or worker
0, raises RuntimeError("injected crash") at its 20th step; only that child crashes, the others go on
feeding the queue, which must not hide the crash."""

import multiprocessing

import common

_iter = common.ExperienceSourceFirstLast.__iter__


def crashing_iter(self):
    for step, exps in enumerate(_iter(self)):
        if step == 20 and multiprocessing.current_process().name in ("play process", "worker 0"):
            raise RuntimeError("injected crash")
        yield exps


common.ExperienceSourceFirstLast.__iter__ = crashing_iter
