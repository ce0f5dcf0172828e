"""A run's processes and what they share: children started with spawn and their messages, shared
memory and its check, and the weights the main process publishes for its children on a GPU."""

import copy
import math
import multiprocessing.connection
import os
import shutil
import signal
import sys
import time
import weakref

import torch

import runs


# ---------------------------------------------------------------- child processes
class ChildProcesses:
    """Children ({name: args}) started with spawn, each running target(*args, send=send) on a pipe
    of its own, send waiting until this process takes the message; iterating yields them and raises
    runs.ProcessLost at a death."""

    def __init__(self, target, children):
        # CUDA needs spawn; macOS and Windows use it.
        ctx = torch.multiprocessing.get_context("spawn")
        self.pipes, self.child_ends = map(list, zip(*(ctx.Pipe() for _ in children)))
        # The children are daemons, ended at this process's exit.
        self.procs = [
            ctx.Process(target=_child_main, args=(target, args, end), name=name, daemon=True)
            for (name, args), end in zip(children.items(), self.child_ends)
        ]

    def __enter__(self):
        """Start the children with Ctrl-C ignored (inherited): this process alone stops the run."""
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for proc, child_end in zip(self.procs, self.child_ends):
                proc.start()
                child_end.close()  # now the child holds its only end: its death gives EOF here
        finally:
            signal.signal(signal.SIGINT, handler)
        return self

    def __iter__(self):
        """What the children send, in the order it arrives, forever."""
        sentinels = {proc.sentinel: proc for proc in self.procs}
        owners = dict(zip(self.pipes, self.procs))
        while True:
            for ready in multiprocessing.connection.wait(self.pipes + list(sentinels), timeout=1.0):
                if ready in sentinels:
                    raise process_lost(sentinels[ready])
                try:
                    message = ready.recv()
                    ready.send(None)  # taken: the child may go on while this process works on it
                except (EOFError, OSError):
                    # The child is gone, between messages or in the middle of one.
                    raise process_lost(owners[ready]) from None
                yield message

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join(timeout=5)
            proc.kill()  # one that did not end; nothing to one that did
            proc.join()
        for pipe in self.pipes:
            pipe.close()


def process_lost(proc):
    """The error that names a dead child and its exit code (and signal)."""
    proc.join(timeout=5)
    signame = f" ({signal.Signals(-proc.exitcode).name})" if (proc.exitcode or 0) < 0 else ""
    return runs.ProcessLost(f"{proc.name} exited with code {proc.exitcode}{signame}")


def _child_main(target, args, pipe):
    """What a child runs: the script's target, with a send that waits until the message is taken."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # on Windows too, where it is not inherited

    def send(message):
        pipe.send(message)
        pipe.recv()  # the main process has taken the message

    try:
        target(*args, send=send)
    except (BrokenPipeError, ConnectionResetError, EOFError):  # the main process is gone
        sys.exit(1)


# ---------------------------------------------------------------- shared memory
def share_memory(parser, *shared, page_locked=False):
    """Move each tensor, network or SharedWeights into shared memory (page-locked, if asked) before
    any child starts; too little room (Docker gives /dev/shm 64 MiB) stops the run with one line and
    exit code 2."""
    # The tensors are a network's, SharedWeights' flat one, or a tensor given as it is.
    tensors = [
        tensor
        for item in shared
        for tensor in (
            [*item.parameters(), *item.buffers()]
            if isinstance(item, torch.nn.Module)
            else [getattr(item, "flat", item)]
        )
    ]
    needed = sum(tensor.nbytes for tensor in tensors)
    # There is no /dev/shm on macOS and Windows.
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    if free is not None and needed > free:
        parser.error(shm_short(needed, free))
    try:
        for tensor in tensors:
            tensor.share_memory_()
    except (RuntimeError, OSError) as error:
        # This is how torch reports no room, or no shared memory at all.
        parser.error(shm_short(needed, free, error))
    if page_locked:
        for tensor in tensors:
            page_lock(tensor)


def shm_short(needed, free, error=None):
    size = 2 ** math.ceil(math.log2(2 * needed / 2**20))  # MiB: twice the need, a power of 2
    have = (
        f"/dev/shm has {free / 1e6:.1f} MB free"
        if free is not None
        else "the system could not give it"
    )
    why = f" ({str(error).strip().splitlines()[0]})" if error is not None else ""
    return (
        f"shared memory is short: this run shares {needed / 1e6:.1f} MB and {have}{why}; "
        f"in Docker, give the container more with docker run --shm-size={size}m"
    )


def page_lock(tensor):
    """Page-lock this process's mapping of a shared CPU tensor on Linux until it is freed, so GPU
    copies skip the driver's staging buffer; a refusal raises now."""
    if sys.platform != "linux" or tensor.is_pinned():
        return
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())


# ---------------------------------------------------------------- weights for the children
class SharedWeights:
    """The main process's weights in one flat shared CPU tensor, for children that act on a GPU (no
    CUDA tensor crosses processes); a version, as in a seqlock, keeps a child from a torn copy."""

    def __init__(self, net):
        # The children's template is the architecture without its values.
        self.net = copy.deepcopy(net).to("meta")
        self.flat = torch.nn.utils.parameters_to_vector(net.parameters()).detach().cpu()
        # Version 0 is the weights copied above.
        self.version = torch.multiprocessing.get_context("spawn").Value("q", 0)
        self.installed = None  # the version that this process's copy holds

    def publish(self, net):
        """Copy the main process's weights into shared memory (waiting for the copy off the GPU)."""
        flat = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
        self.version.value += 1  # odd: a publish is under way
        self.flat.copy_(flat)
        self.version.value += 1  # even: the weights are whole

    def copy_to(self, device):
        """A child's network on device: its own copy of the published weights."""
        net = copy.deepcopy(self.net).to_empty(device=device)
        self.staging, self.installed = torch.empty_like(self.flat, device=device), None
        if self.staging.is_cuda:
            page_lock(self.flat)
        if not self.refresh(net):
            raise RuntimeError("no whole copy of the published weights within a second")
        return net

    def refresh(self, net):
        """Install the newest weights in net, a child's copy; True once it holds them. A torn copy
        is retaken for up to a second (a main process dying mid-publish leaves the version odd)."""
        for _ in range(1000):
            version = self.version.value
            if version == self.installed:
                return True
            if version % 2 == 0:  # no publish under way
                self.staging.copy_(self.flat)  # waits for the copy to the GPU
                if self.version.value == version:  # and none began meanwhile: the copy is whole
                    with torch.no_grad():
                        values = self.staging.split([param.numel() for param in net.parameters()])
                        for param, value in zip(net.parameters(), values):
                            param.copy_(value.view_as(param))
                    self.installed = version
                    return True
            time.sleep(0.001)
        return False
