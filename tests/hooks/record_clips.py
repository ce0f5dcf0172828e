"""A hook for an A3C script's processes (tests put it in a sitecustomize.py): the process that steps
writes to $RL_TEST_CLIP each gradient clip's max norm and the norm it found, and the norm of the
gradient that each optimizer step applies, a line each."""

import os

import torch

_clip, _step = torch.nn.utils.clip_grad_norm_, torch.optim.Adam.step


def write(line):
    with open(os.environ["RL_TEST_CLIP"], "a") as f:
        f.write(line + "\n")


def recording_clip(parameters, max_norm, *args, **kwargs):
    norm = _clip(parameters, max_norm, *args, **kwargs)
    write(f"clip {max_norm} {float(norm)}")
    return norm


def recording_step(self, *args, **kwargs):
    grads = [p.grad.flatten() for group in self.param_groups for p in group["params"]]
    write(f"step {float(torch.cat(grads).norm())}")
    return _step(self, *args, **kwargs)


torch.nn.utils.clip_grad_norm_, torch.optim.Adam.step = recording_clip, recording_step
