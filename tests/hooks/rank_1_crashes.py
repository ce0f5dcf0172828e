"""A hook for a3c_dist's ranks (tests put it in a sitecustomize.py): rank 1 raises
RuntimeError("injected crash") at its 20th step, in the middle of the run."""

import os

if os.environ.get("RANK") == "1":
    import common

    _iter = common.ExperienceSourceFirstLast.__iter__

    def crashing_iter(self):
        for step, exps in enumerate(_iter(self)):
            if step == 20:
                raise RuntimeError("injected crash")
            yield exps

    common.ExperienceSourceFirstLast.__iter__ = crashing_iter
