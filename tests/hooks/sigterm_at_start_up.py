"""A hook for a script's processes (tests put it in a sitecustomize.py): a SIGTERM as the script
starts, to rank 0 under torchrun: right after runs.setup() (before envs, networks, shared memory and
children exist), or, where $RL_TEST_SIGNAL_AT is "probe", inside dqn_compile's compile probe."""

import os
import signal

import torch

import runs


def signal_now():
    if os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.SIGTERM)


if os.environ.get("RL_TEST_SIGNAL_AT") == "probe":
    compile = torch.compile

    def signalling_compile(fn, **kwargs):
        compiled = compile(fn, **kwargs)

        def call(*args):
            signal_now()
            return compiled(*args)

        return call

    torch.compile = signalling_compile
else:
    setup = runs.setup

    def signalled_setup(*args):
        result = setup(*args)
        signal_now()
        return result

    runs.setup = signalled_setup
