"""A hook for a3c_grad's processes (tests put it in a sitecustomize.py). Worker i trains on its
micro-batches less their first i samples, so the workers' sample counts differ, and worker 0 sends
last. In the main process, the gradient of every step must be the mean of the gradient slots, each
weighted by the samples its own worker reported; the count of steps checked is written to
$RL_TEST_STEPS at its exit."""

import atexit
import multiprocessing
import os
import time

import torch

import common
import processes

shared, counts, checked = {}, {}, []
share_memory = processes.share_memory
iterate = processes.ChildProcesses.__iter__
clip_grad_norm = torch.nn.utils.clip_grad_norm_
unpack_batch_a2c = common.unpack_batch_a2c


def remembering_share_memory(parser, weights, grad_slots, **kwargs):
    shared.update(net=weights, slots=grad_slots)
    return share_memory(parser, weights, grad_slots, **kwargs)


def counting_iter(self):
    for message in iterate(self):
        worker_id, samples = message[:2]
        counts[worker_id] = samples
        yield message


def checking_clip_grad_norm(parameters, *args, **kwargs):
    parameters = list(parameters)
    got = torch.cat([p.grad.flatten() for p in parameters])
    expected = sum(counts[i] * shared["slots"][i] for i in counts) / sum(counts.values())
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-7), (
        "a gradient weighted by another worker's samples"
    )
    checked.append(sorted(counts.values()))
    return clip_grad_norm(parameters, *args, **kwargs)


def unequal_unpack_batch_a2c(exps, *args):
    name = multiprocessing.current_process().name  # "worker i" in a worker, once it runs
    if name.startswith("worker "):
        worker_id = int(name.split()[1])
        exps = exps[worker_id:]
        if worker_id == 0:
            time.sleep(0.02)  # its message comes after the others'
    return unpack_batch_a2c(exps, *args)


def write_count():
    if checked:  # the main process: the others (the resource tracker) check nothing
        with open(os.environ["RL_TEST_STEPS"], "w") as f:
            f.write(str(len(checked)))


processes.share_memory = remembering_share_memory
processes.ChildProcesses.__iter__ = counting_iter
torch.nn.utils.clip_grad_norm_ = checking_clip_grad_norm
common.unpack_batch_a2c = unequal_unpack_batch_a2c
atexit.register(write_count)
