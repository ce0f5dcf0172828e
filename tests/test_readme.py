"""What the README and docs say of the code and the files they point to, checked against them."""

import glob
import os
import re
import subprocess

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from conftest import REPO

LINK = re.compile(r"\]\(([^)\s]+)\)")  # a markdown link's target
ROW = re.compile(r"^\| `(\w+)\.py` \|.*\| `(\w+)\.py` \| \+(\d+) -(\d+) \|", re.MULTILINE)
# a table that samples a run's curve, after the command that prints it
MARKS_TABLE = re.compile(
    r"^`python plot\.py (\S+) --table ([^`]+)`:\n\n((?:\|.*\n)+)", re.MULTILINE
)


def test_the_changed_lines_column_is_what_git_diff_counts():
    with open(os.path.join(REPO, "README.md")) as f:
        rows = ROW.findall(f.read())
    assert len(rows) == 5  # every script but the two that start a chapter
    for script, against, added, removed in rows:
        numstat = subprocess.run(
            ["git", "diff", "--no-index", "--numstat", f"{against}.py", f"{script}.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.split()
        assert numstat[:2] == [added, removed], script


def test_each_curve_table_in_results_is_what_its_command_prints_from_the_committed_events():
    import plot

    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
        tables = MARKS_TABLE.findall(f.read())
    assert len(tables) >= 12
    for run_dir, marks, table in tables:
        assert (
            plot.marks_table(os.path.join(REPO, run_dir), [plot.mark(m) for m in marks.split()])
            == table.strip()
        )


def test_the_solved_at_table_in_results_is_what_its_command_prints_from_the_committed_events():
    import plot

    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
        text = f.read()
    # The table after the paragraph that quotes the command: lines from "|" to the end of each.
    (table,) = re.findall(r"--solved-at docs/runs/\*`[^|]*?\n\n((?:\|[^\n]*\n)+)", text)
    run_dirs = sorted(glob.glob(os.path.join(REPO, "docs", "runs", "*")))
    assert plot.solved_at_table(run_dirs) == table.strip()


def test_results_stays_evidence_in_at_most_6500_words():
    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
        assert len(f.read().split()) <= 6500


def test_the_readme_stays_short_with_its_results_table_in_its_first_60_lines():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert len(text.split()) <= 1300  # about 10 minutes of reading
    assert "| script | 2-core CPU, fp32 |" in "\n".join(text.splitlines()[:60])


def anchors(path):
    """The anchors GitHub gives the headings of a markdown file: the text lowercased, what is not a
    letter, digit, space, hyphen or underscore dropped, spaces made hyphens, a repeat numbered."""
    with open(path) as f:
        headings = [line.lstrip("#").strip() for line in f if re.match(r"#{1,6} ", line)]
    seen, result = {}, set()
    for heading in headings:
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        result.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return result


def test_every_link_and_run_folder_in_the_readme_and_docs_is_there():
    documents = ["README.md"] + [
        os.path.relpath(path, REPO)
        for path in glob.glob(os.path.join(REPO, "docs", "*.md"))
        + glob.glob(os.path.join(REPO, "docs", "notes", "*.md"))
    ]
    for document in documents:
        with open(os.path.join(REPO, document)) as f:
            text = f.read()
        here = os.path.dirname(document)
        targets = [t for t in LINK.findall(text) if not t.startswith(("http://", "https://"))]
        targets += (
            re.findall(r"docs/runs/[\w.-]+", text) if document == "README.md" else []
        )  # play.py's folders
        for target in targets:
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(here, path)) if path else document
            assert os.path.exists(os.path.join(REPO, path)), f"{document}: {target}"
            assert not anchor or anchor in anchors(os.path.join(REPO, path)), (
                f"{document}: {target}"
            )


def test_the_committed_curves_wall_times_go_on_with_their_frames():
    # TensorBoard's wall-clock axis: each tag's events at later frames are no earlier, and a run's
    # curve spans the minutes it ran, not the moment its events were cut down
    for path in glob.glob(os.path.join(REPO, "docs", "runs", "*", "events.*")):
        by_tag = {}
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                by_tag.setdefault(value.tag, []).append((event.step, event.wall_time))
        for tag, events in by_tag.items():
            times = [wall_time for _, wall_time in sorted(events)]
            assert times == sorted(times) and times[-1] - times[0] > 60, f"{path}: {tag}"


def section(path, anchor):
    """A markdown file's text under the heading with GitHub anchor anchor, to the next heading."""
    with open(path) as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"#{1,6} ", line)] + [len(lines)]
    for start, end in zip(starts, starts[1:]):
        if anchor in anchors_of_lines([lines[start]]):
            return "\n".join(lines[start + 1 : end]) + "\n"
    raise AssertionError(f"{path}: no heading #{anchor}")


def anchors_of_lines(lines):
    return {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in lines
    }


def test_the_readmes_pong_solves_are_the_last_column_of_their_runs_curves():
    # Each bold Pong cell "**1.52M, 549 min**" is the last game of the run whose curve table its
    # RESULTS section derives from the committed events: frames to two decimals, run minutes as the
    # cell rounds them.
    import plot

    with open(os.path.join(REPO, "README.md")) as f:
        cells = re.findall(
            r"\[\*\*(?:seed \d+: )?([\d.]+)M, ([\d.]+) min†?\*\*\]\(docs/RESULTS\.md#([\w-]+)\)",
            f.read(),
        )
    assert len(cells) == 13
    for frames, minutes, anchor in cells:
        tables = MARKS_TABLE.findall(section(os.path.join(REPO, "docs", "RESULTS.md"), anchor))
        assert len(tables) == 1, anchor
        run_dir, marks, _ = tables[0]
        header = plot.marks_table(
            os.path.join(REPO, run_dir), [plot.mark(m) for m in marks.split()]
        ).splitlines()[0]
        assert header.split(" | ")[-1].rstrip(" |") == f"{frames}M", anchor
        run_minutes = plot.load_curve(os.path.join(REPO, run_dir), "minutes")[1][-1]
        assert f"{run_minutes:.{len(minutes.partition('.')[2])}f}" == minutes, anchor


def test_each_speed_column_of_the_readme_is_one_call():
    # A column of train frames/s compares scripts, so all its cells come from one bench.py call:
    # one RESULTS section.
    with open(os.path.join(REPO, "README.md")) as f:
        table = re.search(
            r"^\| script \| CartPole, k frames \|.*\n\|.*\n((?:\|.*\n)+)", f.read(), re.MULTILINE
        )
    header = table.group(0).splitlines()[0].strip("|").split("|")
    rows = [row.strip("|").split("|") for row in table.group(1).splitlines()]
    assert len(rows) == 7
    for column, name in enumerate(header):
        if "train frames/s" in name:
            assert len({LINK.search(row[column]).group(1) for row in rows}) == 1, name


def test_the_first_runs_last_line_in_the_readme_has_the_fields_a_run_prints_each_explained():
    import json
    import types

    import runs

    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    first_run = text[text.index("## Set up and first run") : text.index("## Results")]
    line = json.loads(re.search(r"^```\n(\{.*\})\n```$", first_run, re.MULTILINE).group(1))
    tracker = types.SimpleNamespace(
        args=types.SimpleNamespace(script="dqn_fast", env="cartpole"),
        frames=1,
        seconds=1.0,
        rewards=[1.0],
        solved=True,
    )
    assert list(line) == list(runs.RewardTracker.summary(tracker))
    assert line["solved"] is True
    for field in line:
        assert f"`{field}`" in first_run, field
    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
        assert (
            json.dumps(line) in f.read()
        )  # the line RESULTS records with its command, machine and commit


def test_the_fp32_dqn_fast_run_against_dqn_baseline_bf16_as_results_states_it():
    # RESULTS: from 0.6M to 1.3M frames within 1.21 of dqn_baseline --bf16's mean (the most at
    # 736,735); from 1.2M to 1.45M the mean between +17.1 and +17.6, games scoring 8 to 21 (each
    # game's score from the means).
    import plot

    _, fast_frames, fast_means = plot.load_curve(
        os.path.join(REPO, "docs/runs/dqn_fast-pong-20261203-052811"), "frames"
    )
    _, base_frames, base_means = plot.load_curve(
        os.path.join(REPO, "docs/runs/dqn_baseline-pong-20261127-000133"), "frames"
    )
    assert len(fast_frames) == 693  # every game: a score is the change in the window's sum
    scores = []
    for n, mean in enumerate(fast_means):
        window_sum = mean * min(n + 1, 100) - (fast_means[n - 1] * min(n, 100) if n else 0.0)
        scores.append(round(window_sum + (scores[n - 100] if n >= 100 else 0)))

    def mean_at(frames, means, at):  # the mean of the last game ended at or before a frame count
        return means[max(i for i, f in enumerate(frames) if f <= at)]

    grid = sorted(f for f in set(fast_frames) | set(base_frames) if 600_000 <= f <= 1_300_000)
    gaps = [
        abs(mean_at(fast_frames, fast_means, f) - mean_at(base_frames, base_means, f)) for f in grid
    ]
    assert round(max(gaps), 2) == 1.21 and grid[gaps.index(max(gaps))] == 736_735
    late = [i for i, f in enumerate(fast_frames) if 1_200_000 <= f <= 1_450_000]
    assert (
        round(min(fast_means[i] for i in late), 1),
        round(max(fast_means[i] for i in late), 1),
    ) == (17.1, 17.6)
    assert (min(scores[i] for i in late), max(scores[i] for i in late)) == (8, 21)
