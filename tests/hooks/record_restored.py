"""A hook for a script's processes (tests put it in a sitecustomize.py): as the run's loop begins
(runs.Run.__enter__), what the script's checkpoint contents hold (their state_dicts) is saved to
$RL_TEST_RESTORED."""

import os

import torch

import runs

enter = runs.Run.__enter__


def recording_enter(self):
    states = {name: value.state_dict() for name, value in self.contents.items()}
    torch.save(states, os.environ["RL_TEST_RESTORED"])
    return enter(self)


runs.Run.__enter__ = recording_enter
