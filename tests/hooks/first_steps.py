"""A hook for a script's processes (tests put it in a sitecustomize.py): the sum of each parameter
after the optimizer steps listed in $RL_TEST_AT (a JSON list) of the training process (rank 0's
under torchrun) is written, as JSON, to $RL_TEST_STEPS. Children act in lock step with the main
process's steps, so that no timing decides the weights they act with."""

import json
import multiprocessing.connection
import os

import torch

import processes

_step, _wanted, _after = torch.optim.Adam.step, json.loads(os.environ["RL_TEST_AT"]), {}


def recording_step(self, *args, **kwargs):
    result = _step(self, *args, **kwargs)
    recording_step.steps += 1
    if recording_step.steps in _wanted and (os.environ.get("RANK") or "0") == "0":
        _after[recording_step.steps] = [
            float(p.detach().double().sum()) for group in self.param_groups for p in group["params"]
        ]
        with open(os.environ["RL_TEST_STEPS"], "w") as f:
            json.dump(_after, f)
    return result


recording_step.steps = 0
torch.optim.Adam.step = recording_step

# children act with the weights that the main process's steps change: here a child acts again
# only once the main process waits for messages again (done with its message and any step it
# made), and an a3c_grad worker once that step's word has come, so that no timing decides the
# weights it acts with
_send, _wait, _held = (
    multiprocessing.connection.Connection.send,
    multiprocessing.connection.wait,
    [],
)


def held_send(self, obj):
    # the main process's "taken", "step made"
    if obj is None and multiprocessing.parent_process() is None:
        _held.append(self)
    else:
        _send(self, obj)


def releasing_wait(*args, **kwargs):
    while _held:
        try:
            _send(_held.pop(0), None)
        except OSError:  # a child that the end of the run has already ended
            pass
    return _wait(*args, **kwargs)


multiprocessing.connection.Connection.send, multiprocessing.connection.wait = (
    held_send,
    releasing_wait,
)
_child_main = processes._child_main


def lockstep_child_main(target, args, pipe):
    step_receivers = [arg for arg in args if isinstance(arg, multiprocessing.connection.Connection)]

    def lockstep_target(*args, send):
        def lockstep_send(message):
            send(message)
            for step_receiver in step_receivers:
                step_receiver.poll(None)

        target(*args, send=lockstep_send)

    _child_main(lockstep_target, args, pipe)


processes._child_main = lockstep_child_main
