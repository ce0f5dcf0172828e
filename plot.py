#!/usr/bin/env python3
"""Learning curves: the mean reward of the last 100 episodes of each run, against frames or
run minutes, one line per run labelled by its script and name, with the stop reward dashed."""

import os
import re
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import common  # noqa: E402
import runs  # noqa: E402

STAMP = re.compile(r"-\d{8}-\d{6}$")  # the time RewardTracker appends to a run folder's name


def load_curve(run_dir, x):
    """Folder name and (xs, ys) of a run's episodes/avg_reward; ValueError saying why not."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"no such run folder: {run_dir}")
    if not any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir)):
        raise ValueError(f"{run_dir} holds no TensorBoard events")
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    if "episodes/avg_reward" not in events.Tags()["scalars"]:
        raise ValueError(f"{run_dir} has no finished episode yet")
    points = events.Scalars("episodes/avg_reward")
    if x == "frames":
        xs = [p.step for p in points]
    # Run time is summed over a resumed run's segments.
    elif "episodes/minutes" in events.Tags()["scalars"]:
        xs = [p.value for p in events.Scalars("episodes/minutes")]
    else:  # runs logged before run minutes were: wall time from the first event
        start = events.FirstEventTimestamp()
        xs = [(p.wall_time - start) / 60 for p in points]
    return os.path.basename(os.path.normpath(run_dir)), xs, [p.value for p in points]


def marks_table(run_dir, marks):
    """A markdown table of a run's curve at each mark (frames): the mean of the first game that
    ended at or past it and the run minutes then, and in the last column the run's last game."""
    _, frames, means = load_curve(run_dir, "frames")
    minutes = load_curve(run_dir, "minutes")[1]
    columns = [
        next(i for i, f in enumerate(frames) if f >= mark) for mark in marks if mark <= frames[-1]
    ]
    columns.append(len(frames) - 1)
    last = len(columns) - 1

    header = [f"{mark / 1e6:.2f}".removesuffix("0") + "M" for mark in marks[:last]] + [
        f"{frames[-1] / 1e6:.2f}M"
    ]
    rows = [
        ["frames", *header],
        [
            "mean reward of the last 100 games",
            *(f"{means[i]:+.{2 if k == last else 1}f}" for k, i in enumerate(columns)),
        ],
        ["run minutes", *(f"{minutes[i]:.1f}" for i in columns)],
    ]
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines[:1] + ["|---|" + "---:|" * len(columns)] + lines[1:])


# The book's chapter 9 stops at 17 in ptan's smoothed reward: each game moves it by (1 - 0.98) of
# the way to its score, from the first game's score.
BOOK_ALPHA = 0.98
BOOK_BOUNDS = (17, 18)


def game_rewards(run_dir):
    """Each game's reward, in order: logged, or else recovered from the logged means of the last
    100, whose sum gains each new game and loses the one 100 games before. None where the means
    cannot be single games (two games ended at one frame count and kept one point)."""
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    if "episodes/reward" in events.Tags()["scalars"]:
        return [p.value for p in events.Scalars("episodes/reward")]
    means = [p.value for p in events.Scalars("episodes/avg_reward")]
    rewards = []
    for k, mean in enumerate(means):
        previous_sum = means[k - 1] * min(k, 100) if k else 0.0
        reward = mean * min(k + 1, 100) - previous_sum + (rewards[k - 100] if k >= 100 else 0)
        if abs(reward - round(reward)) > 0.05:  # a game's score in Pong is a whole number
            return None
        rewards.append(round(reward))
    return rewards


def solved_at_table(run_dirs):
    """A markdown table: for each run, the frames at which it first met our rule (the mean of its
    last 100 games at the env's bar) and the book's (its smoothed reward at 17, and at 18)."""
    rows = ["| run | games | mean of 100 >= bar | smoothed >= 17 | smoothed >= 18 |"]
    rows.append("|---|---:|---:|---:|---:|")
    for run_dir in run_dirs:
        folder, frames, means = load_curve(run_dir, "frames")
        bar = common.STOP_REWARDS[folder.split("-")[1]]
        full = [f for k, (f, m) in enumerate(zip(frames, means)) if k >= 99 and m >= bar]
        cells = [full[0] if full else None]
        rewards = game_rewards(run_dir)
        if rewards is None:
            cells += ["not derivable"] * len(BOOK_BOUNDS)
        else:
            smoothed = []
            for reward in rewards:
                last = smoothed[-1] if smoothed else reward
                smoothed.append(BOOK_ALPHA * last + (1 - BOOK_ALPHA) * reward)
            for bound in BOOK_BOUNDS:
                reached = [f for f, s in zip(frames, smoothed) if s >= bound]
                cells.append(reached[0] if reached else None)
        text = [
            c if isinstance(c, str) else "not reached" if c is None else f"{c / 1e6:.2f}M"
            for c in cells
        ]
        rows.append(f"| {folder} | {len(means)} | " + " | ".join(text) + " |")
    return "\n".join(rows)


def mark(text):
    """Frames from a mark such as 0.5M or 200k."""
    scale = {"k": 1e3, "M": 1e6}.get(text[-1:], 1)
    return round(float(text[:-1] if scale != 1 else text) * scale)


def labels(folders):
    """Script, env and name of each run (its folder's name without the time), with the time
    where two runs would share a label."""
    short = [STAMP.sub("", folder) for folder in folders]
    return [s if short.count(s) == 1 else f for s, f in zip(short, folders)]


def styles(count):
    """A colour and line style for each of count curves, no two alike: the colour cycle's ten
    colours solid, then again dashed, dotted, dash-dotted."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [
        {
            "color": colors[i % len(colors)],
            "linestyle": ("-", "--", ":", "-.")[i // len(colors) % 4],
        }
        for i in range(count)
    ]


if __name__ == "__main__":
    parser = runs.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders under runs/")
    parser.add_argument(
        "-o",
        "--output",
        default="reward.png",
        metavar="FILE.png",
        help="where to write the plot (default: reward.png)",
    )
    parser.add_argument(
        "--x", choices=["frames", "minutes"], default="frames", help="x axis (default: frames)"
    )
    parser.add_argument(
        "--table",
        nargs="+",
        type=mark,
        metavar="FRAMES",
        help="print each run's table at these frames (0.5M, 200k) and its last game, and no plot",
    )
    parser.add_argument(
        "--solved-at",
        action="store_true",
        help="print the frames at which each run met our rule and the book's, and no plot",
    )
    args = parser.parse_args()
    try:
        if args.solved_at:
            print(solved_at_table(args.run_dirs))
            sys.exit(0)
        if args.table:
            print(
                "\n\n".join(marks_table(run_dir, sorted(args.table)) for run_dir in args.run_dirs)
            )
            sys.exit(0)
        curves = [load_curve(run_dir, args.x) for run_dir in args.run_dirs]
        output = open(args.output, "wb")
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"cannot write {args.output}: {error.strerror}")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    folders = [folder for folder, _, _ in curves]
    for label, style, (_, xs, ys) in zip(labels(folders), styles(len(curves)), curves):
        ax.plot(xs, ys, label=label, **style)
    # Run folders are named runs/<script>-<env>-...
    envs = {part for folder in folders for part in folder.split("-")[1:2]}
    for env in sorted(envs & common.STOP_REWARDS.keys()):
        ax.axhline(common.STOP_REWARDS[env], color="grey", linestyle="--", label=f"{env} solved")
    if args.x == "frames":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 500k, 1M
    ax.set_xlabel("frames" if args.x == "frames" else "run minutes")
    ax.set_ylabel("mean reward, last 100 episodes")
    ax.grid(alpha=0.3)
    # The legend goes beside the curves, never on them.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    fig.savefig(output, format="png", dpi=100)
    output.close()
