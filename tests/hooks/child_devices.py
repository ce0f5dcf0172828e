"""A hook for a script's processes (tests put it in a sitecustomize.py): each child writes to
$RL_TEST_DEVICES/<its name> the device of its network's first convolution."""

import multiprocessing
import os

import torch

_forward, _seen = torch.nn.Conv2d.forward, set()


def recording_forward(self, x):
    name = multiprocessing.current_process().name
    if name != "MainProcess" and name not in _seen:
        _seen.add(name)
        with open(os.path.join(os.environ["RL_TEST_DEVICES"], name), "w") as f:
            f.write(self.weight.device.type)
    return _forward(self, x)


torch.nn.Conv2d.forward = recording_forward
