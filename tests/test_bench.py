"""bench.py --profile: the rules that put a sample in a category, py-spy's raw output read back,
a calibration against a child whose time is known, and short profiled runs; bench.py's measuring
path on a tiny CartPole budget: ceilings, tables, ratios, a failed script (the calibration and the
runs: slow set)."""

import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import types

import pytest
from torch.utils.tensorboard import SummaryWriter

import bench
from conftest import REPO, hook, hooked_env, our_lines

slow = pytest.mark.slow

LOOP = [("<module>", "dqn_fast.py"), ("ExperienceSourceFirstLast.__iter__", "common.py")]
STACKS = [  # (process, stack from the outermost frame in, category)
    ("DQN main", LOOP + [("AtariVectorEnv.step", "ale_py/vector_env.py")], "emulator"),
    (
        "dqn_baseline main",
        LOOP
        + [
            ("FireAndNoopsOnReset.reset", "common.py"),
            ("AtariPreprocessing.reset", "gymnasium/wrappers/atari_preprocessing.py"),
        ],
        "emulator",
    ),
    (
        "DQN main",
        LOOP
        + [
            ("decorate_context", "torch/utils/_contextlib.py"),
            ("DQNAgent.__call__", "dqn_fast.py"),
            ("Module._call_impl", "torch/nn/modules/module.py"),
        ],
        "acting",
    ),
    (
        "DQN main",
        LOOP
        + [
            ("decorate_context", "torch/utils/_contextlib.py"),
            ("no_grad.__enter__", "torch/autograd/grad_mode.py"),
        ],
        "other",  # not training
    ),
    (
        "DQN main",
        [
            ("<module>", "dqn_fast.py"),
            ("calc_loss_dqn", "dqn_fast.py"),
            ("unpack_batch_dqn", "common.py"),
            ("Tensor.to", "torch/_tensor.py"),
        ],
        "training",
    ),
    (
        "DQN main",
        [
            ("<module>", "dqn_fast.py"),
            ("Tensor.backward", "torch/_tensor.py"),
            ("backward", "torch/autograd/__init__.py"),
        ],
        "training",
    ),
    ("DQN main", [("<module>", "dqn_fast.py"), ("Adam.step", "torch/optim/adam.py")], "training"),
    ("DQN main", [("<module>", "dqn_fast.py"), ("ReplayBuffer.sample", "common.py")], "replay"),
    (
        "dqn_compile main",
        [
            ("<module>", "dqn_compile.py"),
            ("ExperienceSourceFirstLast.__iter__", "common.py"),
            ("<lambda>", "dqn_compile.py"),
        ],
        "acting",
    ),  # the wait for the actions
    (
        "dqn_compile main",
        [
            ("<module>", "dqn_compile.py"),
            ("CUDAGraphStep.__call__", "dqn_compile.py"),
            ("CUDAGraph.replay", "torch/cuda/graphs.py"),
        ],
        "training",
    ),  # on the GPU
    (
        "dqn_compile main",
        [
            ("<module>", "dqn_compile.py"),
            ("DeviceReplayBuffer.extend", "dqn_compile.py"),
            ("DeviceReplayBuffer._to_device", "dqn_compile.py"),
        ],
        "replay",
    ),
    ("DQN main", [("<module>", "dqn_fast.py"), ("RewardTracker.update", "runs.py")], "other"),
    (
        "dqn_mp main",
        [
            ("<module>", "dqn_mp.py"),
            ("ChildProcesses.__iter__", "processes.py"),
            ("wait", "multiprocessing/connection.py"),
            ("PollSelector.select", "selectors.py"),
        ],
        "waiting",
    ),
    (
        "dqn_mp main",
        [
            ("<module>", "dqn_mp.py"),
            ("ChildProcesses.__iter__", "processes.py"),
            ("_ConnectionBase.recv", "multiprocessing/connection.py"),
        ],
        "transport",  # unpickling
    ),
    (
        "dqn_mp play process",
        [
            ("play_func", "dqn_mp.py"),
            ("_child_main.<locals>.send", "processes.py"),
            ("_ConnectionBase.send", "multiprocessing/connection.py"),
            ("Connection._send", "multiprocessing/connection.py"),
        ],
        "transport",
    ),
    (
        "dqn_mp play process",
        [
            ("play_func", "dqn_mp.py"),
            ("_child_main.<locals>.send", "processes.py"),
            ("_ConnectionBase.recv", "multiprocessing/connection.py"),
            ("Connection._recv_bytes", "multiprocessing/connection.py"),
            ("Connection._recv", "multiprocessing/connection.py"),
        ],
        "waiting",  # to be taken
    ),
    (
        "a3c_grad main",
        [
            ("<module>", "a3c_grad.py"),
            ("mean_grads", "a3c_grad.py"),
            ("Tensor.to", "torch/_tensor.py"),
        ],
        "training",
    ),
    (
        "a3c_grad worker",
        [
            ("grads_func", "a3c_grad.py"),
            ("_ConnectionBase.recv", "multiprocessing/connection.py"),
            ("Connection._recv", "multiprocessing/connection.py"),
        ],
        "waiting",  # for the step
    ),
    (
        "a3c_data worker",
        [
            ("data_func", "a3c_data.py"),
            ("unpack_batch_a2c", "common.py"),
            ("Module._call_impl", "torch/nn/modules/module.py"),
        ],
        "training",
    ),
    (
        "a3c_dist rank",
        [
            ("<module>", "a3c_dist.py"),
            ("exchange", "a3c_dist.py"),
            ("all_reduce", "torch/distributed/distributed_c10d.py"),
        ],
        "transport",
    ),
    ("a3c_dist rank", [("<module>", "a3c_dist.py"), ("exchange", "a3c_dist.py")], "transport"),
    (
        "a3c_dist rank",
        [("<module>", "a3c_dist.py"), ("clip_grad_norm_", "torch/nn/utils/clip_grad.py")],
        "training",
    ),
]


@pytest.mark.parametrize(
    "process, stack, expected", STACKS, ids=[f"{p}-{c}-{i}" for i, (p, _, c) in enumerate(STACKS)]
)
def test_a_sample_goes_to_the_category_of_its_innermost_known_frame(process, stack, expected):
    assert bench.category(stack) == expected


def raw_line(processes, tid, frames, count):
    chain = [f'process {pid}:"{cmd}"' for pid, cmd in processes]
    thread = f"thread ({tid}): {'MainThread' if tid == processes[-1][0] else 'Thread-1'}"
    return ";".join(chain + [thread] + [f"{f} ({file}:1)" for f, file in frames]) + f" {count}\n"


# py-spy reads a process's command line once, maybe as empty or, before the exec, as its parent's.
@pytest.mark.parametrize(
    "tracker_cmd",
    ["python -c from multiprocessing.resource_tracker import main;main(5)", "", "python dqn_mp.py"],
)
def test_raw_output_is_read_per_process_main_thread_only_without_helpers_or_imports(tracker_cmd):
    main, child = (
        (10, "python dqn_mp.py"),
        (12, "python -c from multiprocessing.spawn import spawn_main"),
    )
    tracker = (11, tracker_cmd)
    lines = [
        raw_line([main], 10, [("<module>", "dqn_mp.py"), ("Adam.step", "torch/optim/adam.py")], 30),
        raw_line(
            [main],
            10,
            [
                ("<module>", "dqn_mp.py"),
                ("SharedWeights.__init__", "processes.py"),
                ("BaseContext.Value", "multiprocessing/context.py"),
                ("Value", "multiprocessing/sharedctypes.py"),
                ("ResourceTracker.ensure_running", "multiprocessing/resource_tracker.py"),
            ],
            1,
        ),
        raw_line([main], 10, [("<module>", "dqn_mp.py"), ("ReplayBuffer.append", "common.py")], 10),
        raw_line(
            [main],
            10,
            [("<module>", "dqn_mp.py"), ("_find_and_load", "<frozen importlib._bootstrap>")],
            99,
        ),
        # This sample is not of the main thread.
        raw_line([main], 13, [("SummaryWriter.flush", "tensorboard/writer.py")], 50),
        raw_line(
            [main, tracker],
            11,
            [("<module>", "<string>"), ("main", "multiprocessing/resource_tracker.py")],
            70,
        ),
        raw_line(
            [main, child], 12, [("play_func", "dqn_mp.py"), ("DQNAgent.__call__", "dqn_mp.py")], 20
        ),
        raw_line(
            [main, child],
            12,
            [("play_func", "dqn_mp.py"), ("AtariVectorEnv.step", "ale_py/vector_env.py")],
            5,
        ),
    ]
    labelled = bench.label_processes(bench.read_raw(lines), "play process")
    assert labelled == {
        "main process": {"training": 30, "replay": 10, "other": 1},
        "play process": {"acting": 20, "emulator": 5},
    }


def test_torchrun_ranks_are_the_processes_and_the_agent_is_left_out():
    agent = (20, "")  # py-spy read the agent's command line as empty in one run of bench.py
    lines = [raw_line([agent], 20, [("main", "torch/distributed/run.py")], 40)]
    lines += [
        raw_line(
            [agent, (pid, "python -u a3c_dist.py")],
            pid,
            [("<module>", "a3c_dist.py"), ("exchange", "a3c_dist.py")],
            7,
        )
        for pid in (22, 21)
    ]
    assert bench.label_processes(bench.read_raw(lines), "rank") == {
        "rank 0": {"transport": 7},
        "rank 1": {"transport": 7},
    }


CALIBRATION = """
import multiprocessing, time
def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
def child(conn):
    while conn.recv() is not None:   # waits 50 ms in the pipe for each message
        busy(0.05)                   # then computes 50 ms
if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=child, args=(theirs,))
    proc.start()
    time.sleep(3)                    # the child's start-up, which imports nothing to leave out
    for _ in range(60):              # 6 s: a message every 100 ms
        ours.send(1)
        time.sleep(0.1)
    ours.send(None)
    proc.join()
"""


@slow
def test_calibration_a_child_that_waits_half_its_time_in_a_pipe_reads_half_waiting(tmp_path):
    """Sampling at 100 Hz for the 6 s of messages, about 600 samples of the child's messages (and
    300 of its start-up wait, waiting too): a binomial share of 600 has a standard deviation of 2
    points; py-spy pausing the child to sample it shifts its timing a little. Tolerance: 10 points
    around the 50% of the 6 s, with the 3 s of waiting before the first message counted in."""
    (tmp_path / "calibrate.py").write_text(CALIBRATION)
    labelled = bench.profile(
        [sys.executable, str(tmp_path / "calibrate.py")], str(tmp_path / "raw"), tmp_path, rate=100
    )
    counts = labelled["child"]
    total = sum(counts.values())
    expected = (3 + 0.5 * 6) / 9  # waiting: all of the first 3 s, half of the next 6
    assert total > 500
    assert abs(counts["waiting"] / total - expected) < 0.10, counts
    # Plain Python is "other".
    assert counts["waiting"] + counts["transport"] + counts["other"] == total


def test_py_spy_is_found_where_pip_put_it_beside_a_python_run_without_activating_its_environment(
    tmp_path, monkeypatch
):
    scripts = tmp_path / "venv-bin"
    scripts.mkdir()
    (scripts / "py-spy").write_text("#!/bin/sh\n")
    (scripts / "py-spy").chmod(0o755)
    # The environment is not activated: its folder is not on PATH.
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(
        bench.sysconfig,
        "get_path",
        lambda name, scheme=None: str(scripts) if scheme is None else str(tmp_path / "user-bin"),
    )
    assert bench.find_py_spy() == str(scripts / "py-spy")
    (scripts / "py-spy").unlink()
    assert bench.find_py_spy() is None


def test_where_py_spy_may_not_trace_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "py-spy"
    fake.write_text(
        "#!/bin/sh\necho 'Error: Permission denied (os error 13): ptrace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(bench, "find_py_spy", lambda: str(fake))
    with pytest.raises(SystemExit) as exit_info:
        bench.profile([sys.executable, "-c", "pass"], str(tmp_path / "raw"), tmp_path)
    err = capsys.readouterr().err
    (line,) = our_lines(err)
    assert exit_info.value.code == 2
    assert (
        line.startswith("bench.py: error: py-spy may not trace") and "--cap-add SYS_PTRACE" in line
    )


@slow
def test_a_profiled_cartpole_run_finds_every_process_and_its_work(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "bench.py"),
            "--profile",
            "--env",
            "cartpole",
            "--frames",
            "2000",
            "--seconds",
            "0.5",
            "--scripts",
            "dqn_baseline",
            "dqn_mp",
            "--png",
            str(tmp_path / "profile.png"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {
        tuple(cell.strip() for cell in line.split("|")[1:3]): line
        for line in proc.stdout.splitlines()
        if line.startswith("| dqn_")
    }
    shares = {
        key: dict(
            zip(bench.CATEGORIES, (float(c.strip().rstrip("%")) for c in line.split("|")[3:-2]))
        )
        for key, line in rows.items()
        if "process" in key[1]
    }  # the shares table's rows
    assert set(shares) == {
        ("dqn_baseline", "main process"),
        ("dqn_mp", "main process"),
        ("dqn_mp", "play process"),
    }
    play = shares[("dqn_mp", "play process")]
    # It plays: on CartPole the emulator's share is under 1% of a process that mostly waits.
    assert play["acting"] + play["emulator"] > 0 and play["training"] == 0 and play["waiting"] > 30
    assert shares[("dqn_mp", "main process")]["training"] > 10
    assert shares[("dqn_baseline", "main process")]["training"] > 10
    assert (tmp_path / "profile.png").stat().st_size > 10_000


# ---------------------------------------------------------------- the measuring path
def bench_run(cwd, *args, env=None):
    """bench.py on CartPole with a tiny budget: its exit code, output and errors."""
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "bench.py"),
            "--env",
            "cartpole",
            "--frames",
            "300",
            "--seconds",
            "0.3",
            *args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout, proc.stderr


def summaries(err):
    """{label: JSON summary} of each script's run, as bench.py reports them on stderr."""
    return {
        label.strip(): json.loads(value)
        for label, value in (
            line.split(": ", 1)
            for line in err.splitlines()
            if line.startswith("  ") and ": {" in line
        )
    }


def table(out):
    """The table's rows, {script: its cells after the name}."""
    rows = (
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| dqn_")
    )
    return {cells[0]: cells[1:] for cells in rows}


@slow
def test_bench_measures_the_ceilings_and_each_script_and_tables_their_ratios(tmp_path):
    code, out, err = bench_run(tmp_path, "--scripts", "dqn_baseline", "dqn_fast")
    assert code == 0, err
    found = re.search(
        r"env \(C\+\+ vector env, 8 envs, random actions\) (\d+) frames/s, with 3 envs (\d+); "
        r"DQN net \(batch 32 training step\) (\d+) frames/s",
        out,
    )
    assert found, out
    ceilings = dict(zip(["env, 8 envs", "env, 3 envs", "DQN net"], map(int, found.groups())))
    assert min(ceilings.values()) > 0
    runs, rows = summaries(err), table(out)
    assert set(rows) == set(runs) == {"dqn_baseline", "dqn_fast"}
    for script, (fps, ratio, fraction, rss) in rows.items():
        run = runs[script]
        # The frames are CartPole's warm-up, then 300; the run said nothing to warn of.
        assert run["frames"] >= 1000 + 300 and fps == f"{run['train_fps']:.0f}"
        assert run["warnings"] == []
        assert ratio == f"{run['train_fps'] / runs['dqn_baseline']['train_fps']:.2f}x"
        bound = min(["DQN net", "env, 3 envs"], key=ceilings.get)
        percent, which = fraction.split(" ", 1)
        assert which == f"({bound})"
        assert float(percent.rstrip("%")) == pytest.approx(
            100 * run["train_fps"] / ceilings[bound], rel=0.02, abs=1
        )
        assert (
            float(rss.split()[0]) == pytest.approx(run["peak_rss"] / 2**30, abs=0.006)
            and run["peak_rss"] > 0
        )


def test_the_workers_ceiling_has_a_rate_from_each_process_and_leaves_none_behind():
    rates = bench.workers_rates("cartpole", 2, 2, 0.2, 1)
    assert len(rates) == 2 and min(rates) > 0
    assert not multiprocessing.active_children()


@slow
def test_bench_bf16_tables_each_script_in_both_precisions_and_their_ratio(tmp_path):
    code, out, err = bench_run(tmp_path, "--bf16", "--scripts", "dqn_fast")
    assert code == 0, err
    runs = summaries(err)
    assert set(runs) == {"dqn_fast", "dqn_fast --bf16"}
    fp32, bf16 = runs["dqn_fast"]["train_fps"], runs["dqn_fast --bf16"]["train_fps"]
    assert table(out)["dqn_fast"][:3] == [f"{fp32:.0f}", f"{bf16:.0f}", f"{bf16 / fp32:.2f}x"]
    assert "Ceilings with bf16: DQN net " in out


def test_bench_twice_runs_two_copies_at_once_and_tables_each_against_one_alone(monkeypatch, capsys):
    started, ended = [], []

    def fake_run(script, args, warmup):
        started.append(time.monotonic())
        time.sleep(0.3)
        ended.append(time.monotonic())
        return {"script": script, "train_fps": 100.0 if len(started) == 1 else 45.0}

    monkeypatch.setattr(bench, "run_script", fake_run)
    bench.bench_twice(types.SimpleNamespace(scripts=["dqn_fast"], env="cartpole"))
    # The copies start before either ends, after the one alone.
    assert ended[0] <= min(started[1:]) and max(started[1:]) < min(ended[1:])
    assert "| dqn_fast | 100 | 45, 45 | 0.45x, 0.45x |" in capsys.readouterr().out


@slow
def test_a_script_that_fails_under_bench_ends_it_with_one_line_and_exit_code_2(tmp_path):
    code, out, err = bench_run(
        tmp_path, "--scripts", "dqn_fast", env=hooked_env(tmp_path, hook("dqn_fast_fails"))
    )
    assert code == 2 and "| dqn_fast" not in out
    assert our_lines(err) == [
        "bench.py: error: dqn_fast exited with code 2: dqn_fast.py: error: injected"
    ]


def test_train_fps_counts_from_the_first_loss_to_the_last_record_of_the_run(tmp_path):
    # By hand: warm-up games to 1,000 frames, the first loss at 1,000 frames and 20 s (the first
    # step compiled until then), the last record at 3,000 frames and 30 s: 2,000 frames in 10 s.
    writer = SummaryWriter(tmp_path / "runs" / "x")
    writer.add_scalar("episodes/reward", -21.0, 500, walltime=1.0)
    writer.add_scalar("train/loss", 0.5, 1000, walltime=20.0)
    writer.add_scalar("episodes/reward", -20.0, 2500, walltime=25.0)
    writer.add_scalar("train/loss", 0.4, 3000, walltime=30.0)
    writer.close()
    assert bench.train_fps(tmp_path) == 200.0
