"""A hook for a script's processes (tests put it in a sitecustomize.py): torch.compile leaves a
function as it is, so that every training step runs in Python, and each DQN loss adds the samples it
is computed on to a total written at the process's exit to $RL_TEST_SAMPLES."""

import atexit
import os

import torch
import torch.nn.functional as F

torch.compile = lambda fn, **kwargs: fn
samples = []
mse_loss = F.mse_loss


def counting_mse_loss(input, target, *args, **kwargs):
    samples.append(len(input))
    return mse_loss(input, target, *args, **kwargs)


def write_total():
    if samples:
        with open(os.environ["RL_TEST_SAMPLES"], "w") as f:
            f.write(str(sum(samples)))


F.mse_loss = counting_mse_loss
atexit.register(write_total)
