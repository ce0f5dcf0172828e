"""The disk as a resource: a run whose folder cannot be written stops at once with one line; a run
whose disk fills ends with one line, its summary and exit code 2, and keeps what it had written
whole (the checkpoint before, best.pt); a resumed run holds no mapping of the checkpoint it
replaced. The faults are made for real: a small or read-only tmpfs at runs/, in a user and mount
namespace (Linux)."""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import runs
from conftest import REPO, our_lines, summary

SCRIPT = [sys.executable, os.path.join(REPO, "dqn_fast.py"), "--env", "cartpole"]


def on_small_disk(kib, command, read_only=False, copy=None, keep=False):
    """The command line that runs command with runs/ a tmpfs of kib KiB of its own (holding a copy
    of the folder copy, if given; read-only, if asked; copied to kept/ at the end, if asked), in a
    user and mount namespace; None where that cannot be made."""
    mount = f"mkdir -p runs && mount -t tmpfs -o size={kib}k tmpfs runs"
    if copy:
        mount += f" && cp -r {copy} runs/"
    if read_only:
        mount += " && mount -o remount,ro runs"
    run = '"$@"; code=$?; cp -r runs kept; exit $code' if keep else 'exec "$@"'
    wrapped = ["unshare", "-rm", "sh", "-c", f"{mount} && {run}", "sh", *command]
    try:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True
        )
    except OSError:
        return None
    return wrapped if probe.returncode == 0 else None


def run_on_small_disk(tmp_path, kib, *args, read_only=False, copy=None, keep=False):
    """Run dqn_fast on CartPole with args, runs/ a small disk: (exit code, stdout, stderr)."""
    command = on_small_disk(kib, [*SCRIPT, *args], read_only, copy, keep)
    if command is None:
        pytest.skip("no user and mount namespaces here (unshare -rm)")
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def made_run(where, frames):
    """A run of dqn_fast on CartPole stopped at frames, made in the folder where on the ordinary
    disk: its run folder and its summary."""
    where.mkdir(exist_ok=True)
    proc = subprocess.run(
        [*SCRIPT, "--max-frames", str(frames)],
        cwd=where,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    (folder,) = (where / "runs").iterdir()
    return folder, summary(proc.stdout)


FULL = r"cannot write runs/dqn_fast-cartpole-[\d-]+/{} \(No space left on device\)"


def test_a_file_where_runs_should_be_stops_the_run_at_once_with_one_line(tmp_path):
    (tmp_path / "runs").write_text("not a folder")
    proc = subprocess.run([*SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = our_lines(proc.stderr)
    assert re.fullmatch(
        r"dqn_fast.py: error: cannot write in runs/dqn_fast-cartpole-[\d-]+ \(Not a directory\)",
        line,
    )


def test_a_read_only_runs_folder_stops_the_run_at_once_with_one_line(tmp_path):
    code, out, err = run_on_small_disk(tmp_path, 64, read_only=True)
    assert code == 2 and out == ""
    (line,) = our_lines(err)
    assert re.fullmatch(
        r"dqn_fast.py: error: cannot write in runs/dqn_fast-cartpole-[\d-]+ "
        r"\(Read-only file system\)",
        line,
    )


@pytest.mark.slow
def test_resume_of_a_folder_on_a_read_only_disk_stops_at_once_with_one_line(tmp_path):
    folder, _ = made_run(tmp_path / "made", 300)
    code, out, err = run_on_small_disk(
        tmp_path, 2048, "--resume", f"runs/{folder.name}", read_only=True, copy=str(folder)
    )
    assert code == 2 and out == ""
    assert our_lines(err) == [
        f"dqn_fast.py: error: cannot write in runs/{folder.name} (Read-only file system)"
    ]


def loads(path):
    """Whether path holds a whole torch file."""
    return bool(torch.load(path, weights_only=True))


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_ends_the_run_with_one_line_and_leaves_the_last_whole(
    tmp_path,
):
    # A run past its first training step, its checkpoint (355 kB) holding Adam's moments, resumed on
    # a disk of its folder's size and 160 KiB more: room for a new best.pt (72 kB) and the events
    # (under 30 kB), never for a new checkpoint beside the old, which only grows.
    folder, _ = made_run(tmp_path / "made", 1200)
    # The size is counted in tmpfs pages.
    kib = sum(-(-path.stat().st_size // 4096) * 4 for path in folder.iterdir()) + 160
    code, out, err = run_on_small_disk(
        tmp_path,
        kib,
        "--resume",
        f"runs/{folder.name}",
        "--max-frames",
        "50000",
        "--checkpoint-minutes",
        "0.005",
        copy=str(folder),
        keep=True,
    )
    (line,) = our_lines(err)
    assert code == 2 and re.fullmatch("dqn_fast.py: error: " + FULL.format("checkpoint.pt"), line)
    result = summary(out)
    assert 1200 < result["frames"] < 50000 and not result["solved"]
    # The checkpoint it resumed from and best.pt are whole; no temporary is left.
    kept = tmp_path / "kept" / folder.name
    assert loads(kept / runs.CHECKPOINT) and loads(kept / "best.pt")
    assert (kept / runs.CHECKPOINT).read_bytes() == (folder / runs.CHECKPOINT).read_bytes()
    assert not (kept / (runs.CHECKPOINT + ".tmp")).exists()


@pytest.mark.slow
def test_a_solved_run_whose_last_checkpoint_does_not_fit_ends_with_one_line_and_its_solve(tmp_path):
    # 512 KiB: room for the events and best.pt (under 150 kB), not for the checkpoint of a full
    # buffer (700 kB).
    code, out, err = run_on_small_disk(tmp_path, 512, "--seed", "1", "--max-frames", "50000")
    assert code == 2, err
    assert summary(out)["solved"]
    (line,) = our_lines(err)
    assert re.fullmatch("dqn_fast.py: error: " + FULL.format("checkpoint.pt"), line), line


@pytest.mark.slow
def test_a_best_pt_that_does_not_fit_ends_the_run_with_one_line(tmp_path):
    # 32 KiB: best.pt (70 kB) never fits; the events of 100 games (about 20 kB) do.
    code, out, err = run_on_small_disk(
        tmp_path, 32, "--max-frames", "20000", "--checkpoint-minutes", "0"
    )
    (line,) = our_lines(err)
    assert code == 2 and re.fullmatch("dqn_fast.py: error: " + FULL.format("best.pt"), line), line
    result = summary(out)
    assert result["episodes"] == 100 and not result["solved"]


@pytest.mark.slow
def test_events_that_do_not_fit_end_the_run_with_one_line(tmp_path):
    # 8 KiB: the events of the first few dozen games fill it, long before 100 games make a best.pt.
    code, out, err = run_on_small_disk(
        tmp_path, 8, "--max-frames", "20000", "--checkpoint-minutes", "0"
    )
    (line,) = our_lines(err)
    assert code == 2 and re.fullmatch(
        r"dqn_fast.py: error: cannot write in runs/dqn_fast-cartpole-[\d-]+ "
        r"\(No space left on device\)",
        line,
    ), line
    assert summary(out)["episodes"] < 100


# ---------------------------------------------------------------- a resumed run's mapping
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc/PID/maps")
def test_a_resumed_run_holds_no_mapping_of_the_checkpoint_it_replaced(tmp_path):
    folder, _ = made_run(tmp_path, 1200)
    proc = subprocess.Popen(
        [
            *SCRIPT,
            "--resume",
            str(folder),
            "--max-frames",
            "1000000000",
            "--checkpoint-minutes",
            "0.005",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The checkpoint it resumed from is replaced.
        while "checkpoint written" not in proc.stdout.readline():
            assert proc.poll() is None, proc.stderr.read()
        with open(f"/proc/{proc.pid}/maps") as f:
            mapped = [line for line in f if runs.CHECKPOINT in line]
        assert mapped == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
