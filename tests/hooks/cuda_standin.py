"""A hook for a script's processes (tests put it in a sitecustomize.py): --cuda's lines on a CPU.
A "cuda" device is the CPU, there is one GPU, its generator is torch's, processes.page_lock checks
that it is given a shared CPU tensor, torch.compile traces and runs as on a CPU (where it records no
CUDA graph), and $RL_TEST_EAGER, where set, leaves torch.compile out. What only a GPU runs stays
untested here: CUDA graphs, page-locked and non-blocking copies (docs/HOW.md)."""

import os

import torch

_device = torch.device


class _DeviceType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _device)


class StandInDevice(metaclass=_DeviceType):
    def __new__(cls, kind, index=None):
        if str(kind).startswith("cuda"):
            return _device("cpu")
        return _device(kind) if index is None else _device(kind, index)


torch.device = StandInDevice
torch.cuda.is_available = lambda: True
torch.accelerator.current_accelerator = lambda check_available=False: None  # what Adam asks
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda device: None
torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, device="cuda": None
_compile = torch.compile


# torch.compile's, traced and run as on a CPU, where it sees no GPU
class StandInCompiled(torch.nn.Module):
    def __init__(self, fn, **kwargs):
        super().__init__()
        self.compiled = _compile(fn, **kwargs)  # a module's parameters are this one's too

    def forward(self, *args, **kwargs):
        torch.cuda.is_available = lambda: False
        try:
            return self.compiled(*args, **kwargs)
        finally:
            torch.cuda.is_available = lambda: True


torch.compile = (lambda fn, **kwargs: fn) if os.environ.get("RL_TEST_EAGER") else StandInCompiled
# processes is imported once torch is patched, as a script imports it
import processes  # noqa: E402


def page_lock(tensor):
    assert tensor.device.type == "cpu" and tensor.is_shared(), "page_lock takes a shared CPU tensor"


processes.page_lock = page_lock
