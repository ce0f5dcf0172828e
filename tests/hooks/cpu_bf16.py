"""A hook for a script's processes (tests put it in a sitecustomize.py): the CPU's capabilities as
torch reads them, but for bfloat16: native where $RL_TEST_BF16 is 1, emulated otherwise."""

import os
import types

import torch

_real, _native = torch.cpu.get_capabilities(), os.environ["RL_TEST_BF16"] == "1"
torch.cpu.get_capabilities = lambda: types.MappingProxyType(
    {**_real, "avx512_bf16": _native, "amx_bf16": _native, "bf16": _native}
)
