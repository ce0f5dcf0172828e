"""A hook for a script's processes (tests put it in a sitecustomize.py): every process saves, at its
first optimizer step, the gradient it applies and the weights it makes, to
$RL_TEST_FIRST_STEP/<$RANK, or its process name>."""

import multiprocessing
import os

import torch

_step = torch.optim.Adam.step


def saving_step(self, *args, **kwargs):
    params = [p for group in self.param_groups for p in group["params"]]
    grads = [p.grad.detach().cpu().clone() for p in params]
    result = _step(self, *args, **kwargs)
    name = os.environ.get("RANK") or multiprocessing.current_process().name
    path = os.path.join(os.environ["RL_TEST_FIRST_STEP"], name)
    if not os.path.exists(path):
        torch.save((grads, [p.detach().cpu() for p in params]), path)
    return result


torch.optim.Adam.step = saving_step
