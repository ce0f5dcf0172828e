"""A hook for a3c_dist's ranks (tests put it in a sitecustomize.py): rank 1 reports 40 finished
episodes of reward 0.5 (not a CartPole score) at its third report."""

import os

import common

_pop, _calls = common.ExperienceSourceFirstLast.pop_episodes, []


def pop_episodes(self):
    episodes = _pop(self)
    _calls.append(None)
    if os.environ.get("RANK") == "1" and len(_calls) == 3:
        episodes += [(0.5, 3)] * 40
    return episodes


common.ExperienceSourceFirstLast.pop_episodes = pop_episodes
