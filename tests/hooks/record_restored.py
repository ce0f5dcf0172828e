"""A hook for a script's processes (tests put it in a sitecustomize.py): as the run's loop begins
(runs.Run.__enter__), what the script's checkpoint contents hold (their state_dicts) is saved to
$RL_TEST_RESTORED."""

import os

import torch

import runs

enter = runs.Run.__enter__


def recording_enter(self):
    contents = self.contents()
    torch.save(
        {
            name: value.state_dict() if hasattr(value, "state_dict") else value
            for name, value in contents.items()
        },
        os.environ["RL_TEST_RESTORED"],
    )
    return enter(self)


runs.Run.__enter__ = recording_enter
