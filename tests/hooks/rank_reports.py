"""A hook for a3c_dist's ranks (tests put it in a sitecustomize.py): each time a rank's experience
source hands over its finished episodes (once a micro-batch, when the rank reports), the rank's
frames and the count of those episodes go on a line of the file $RL_TEST_REPORTS/<RANK>."""

import os

import common

pop_episodes = common.ExperienceSourceFirstLast.pop_episodes


def recording_pop_episodes(self):
    finished = pop_episodes(self)
    with open(os.path.join(os.environ["RL_TEST_REPORTS"], os.environ["RANK"]), "a") as f:
        f.write(f"{self.frames} {len(finished)}\n")
    return finished


common.ExperienceSourceFirstLast.pop_episodes = recording_pop_episodes
