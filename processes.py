"""A run's processes and what they share: children started with spawn and their messages, shared
memory and its check, and the weights the main process publishes for its children on a GPU."""
import copy
import math
import multiprocessing.connection
import signal
import sys
import time
import weakref

import torch

import runs


# ---------------------------------------------------------------- child processes
class ChildProcesses:
    """Children started with spawn, each running target(*args, send=send) on a pipe of its own; send
    returns once this process has taken the message. Iterating yields the messages and raises
    runs.ProcessLost once a child is dead; leaving the with-block ends them all (docs/HOW.md)."""

    def __init__(self, target, children):
        """children: {name: args} for each child process."""
        ctx = torch.multiprocessing.get_context("spawn")   # CUDA needs spawn; macOS and Windows use it
        self.procs, self.pipes, self.child_ends = [], [], []
        for name, args in children.items():
            pipe, child_end = ctx.Pipe()
            self.procs.append(ctx.Process(target=_child_main, args=(target, args, child_end), name=name,
                                          daemon=True))   # ended at exit even if a later start fails
            self.pipes.append(pipe)
            self.child_ends.append(child_end)

    def __enter__(self):
        """Start the children with Ctrl-C ignored, which they inherit: a terminal sends it to the whole
        process group, and the run stops through this process alone (docs/HOW.md)."""
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for proc, child_end in zip(self.procs, self.child_ends):
                proc.start()
                child_end.close()   # now the child holds its only end: its death gives EOF here
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
                    ready.send(None)          # taken: the child may go on while this process works on it
                except (EOFError, OSError):   # the child is gone, between messages or in the middle of one
                    raise process_lost(owners[ready]) from None
                yield message

    def __exit__(self, *exc):
        """Terminate the children and wait for them; kill those that do not end."""
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in self.pipes:
            pipe.close()


def process_lost(proc):
    """The error that names a dead child and its exit code (and signal)."""
    proc.join(timeout=5)
    code = proc.exitcode
    signame = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
    return runs.ProcessLost(f"{proc.name} exited with code {code}{signame}")


def _child_main(target, args, pipe):
    """What a child runs: the script's target, with a send that waits until the message is taken."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # on Windows too, where it is not inherited

    def send(message):
        pipe.send(message)
        pipe.recv()   # the main process has taken the message

    try:
        target(*args, send=send)
    except (BrokenPipeError, ConnectionResetError, EOFError):   # the main process is gone
        sys.exit(1)


# ---------------------------------------------------------------- shared memory
def share_memory(parser, *shared, page_locked=False):
    """Move each tensor, network or SharedWeights into shared memory before any child starts (with
    page_locked, page-lock this process's mapping too). Too little room (Docker gives /dev/shm 64 MiB),
    counted first on Linux or as torch fails anywhere, stops the run with one line and exit code 2."""
    tensors = [tensor for item in shared for tensor in _tensors(item)]
    needed, free = sum(tensor.nbytes for tensor in tensors), runs.free_bytes("/dev/shm")   # None: macOS, Windows
    if free is not None and needed > free:
        parser.error(shm_short(needed, free))
    try:
        for tensor in tensors:
            tensor.share_memory_()
    except (RuntimeError, OSError) as error:   # how torch reports no room, or no shared memory at all
        parser.error(shm_short(needed, free, error))
    if page_locked:
        for tensor in tensors:
            page_lock(tensor)


def _tensors(item):
    """The tensors that sharing a tensor, a network or SharedWeights moves."""
    if isinstance(item, torch.Tensor):
        return [item]
    if isinstance(item, torch.nn.Module):
        return [*item.parameters(), *item.buffers()]
    return [item.flat]


def shm_short(needed, free, error=None):
    """The one line for a run that needs `needed` bytes of shared memory and cannot have them."""
    size = 2 ** math.ceil(math.log2(2 * needed / 2 ** 20))   # MiB: twice the need, a power of 2
    have = f"/dev/shm has {free / 1e6:.1f} MB free" if free is not None else "the system could not give it"
    why = f" ({str(error).strip().splitlines()[0]})" if error is not None else ""
    return (f"shared memory is short: this run shares {needed / 1e6:.1f} MB and {have}{why}; "
            f"in Docker, give the container more with docker run --shm-size={size}m")


def page_lock(tensor):
    """Page-lock this process's own mapping of a shared CPU tensor, on Linux, until the tensor is freed: GPU
    copies skip the driver's staging buffer; a refusal raises now (why each process, and only Linux: docs/HOW.md)."""
    if sys.platform != "linux" or tensor.is_pinned():
        return
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())


# ---------------------------------------------------------------- weights for the children
class SharedWeights:
    """The main process's weights in one flat shared CPU tensor, for children that act on a GPU (no
    CUDA tensor crosses a process boundary: Windows lacks CUDA IPC). A version, as in a seqlock, keeps
    a child from installing a copy that a publish overlapped (docs/HOW.md)."""

    def __init__(self, net):
        self.net = copy.deepcopy(net).to("meta")   # the children's template: the architecture without its values
        self.flat = torch.nn.utils.parameters_to_vector(net.parameters()).detach().cpu()
        self.version = torch.multiprocessing.get_context("spawn").Value("q", 0)   # 0: the weights copied above
        self.installed = None   # the version that this process's copy holds

    def publish(self, net):
        """Copy the main process's weights into shared memory (waiting for the copy off the GPU)."""
        with torch.no_grad():
            flat = torch.nn.utils.parameters_to_vector(net.parameters())
        self.version.value += 1   # odd: a publish is under way
        self.flat.copy_(flat)
        self.version.value += 1   # even: the weights are whole

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
        """Install the newest published weights in net, a child's copy, if newer; True once it holds them.
        A copy that a publish overlapped is taken again for up to a second; after that (a main process
        that died mid-publish leaves the version odd) net keeps the weights it has."""
        for _ in range(1000):
            version = self.version.value
            if version == self.installed:
                return True
            if version % 2 == 0:                      # no publish under way
                self.staging.copy_(self.flat)         # waits for the copy to the GPU
                if self.version.value == version:     # and none began meanwhile: the copy is whole
                    self._install(net)
                    self.installed = version
                    return True
            time.sleep(0.001)
        return False

    @torch.no_grad()
    def _install(self, net):
        """Copy the staging buffer into net's parameters."""
        for param, value in zip(net.parameters(), self.staging.split([p.numel() for p in net.parameters()])):
            param.copy_(value.view_as(param))
