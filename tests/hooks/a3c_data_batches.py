"""A hook for a3c_data's processes (tests put it in a sitecustomize.py). In the main process: each
message's states are copied from the worker's slot as the message is taken (the worker refills that
slot only after its next message is taken), and every batch the network trains on must be the
micro-batches taken since the last, in the order taken; the count of batches checked is written to
$RL_TEST_BATCHES at its exit. Run with one worker, whose slot is refilled before a batch of four
micro-batches is whole."""

import atexit
import multiprocessing
import os

import torch

import processes

shared, taken, checked = {}, [], []
share_memory = processes.share_memory
iterate = processes.ChildProcesses.__iter__


def remembering_share_memory(parser, weights, sample_slots, **kwargs):
    shared.update(net=weights, slots=sample_slots)
    return share_memory(parser, weights, sample_slots, **kwargs)


def check_batch(net, args):
    expected = torch.cat(taken)
    taken.clear()
    assert torch.equal(args[0], expected), (
        "the main process trained on states the worker did not send"
    )
    checked.append(len(expected))


def copying_iter(self):
    # The hook goes on after the children started, so it is not pickled to them.
    shared["net"].register_forward_pre_hook(check_batch)
    for message in iterate(self):
        worker_id, slot, actions = message[:3]
        taken.append(shared["slots"][worker_id, slot, : len(actions)].clone())
        yield message


def write_count():
    if checked:  # the main process: the others (the resource tracker) check nothing
        with open(os.environ["RL_TEST_BATCHES"], "w") as f:
            f.write(str(len(checked)))


if multiprocessing.parent_process() is None:
    processes.share_memory = remembering_share_memory
    processes.ChildProcesses.__iter__ = copying_iter
    atexit.register(write_count)
