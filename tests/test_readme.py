"""What the README and the docs say of the code and of the files they point to, checked against them."""
import glob
import os
import re
import subprocess
import sys

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]+)\)")   # a markdown link's target
ROW = re.compile(r"^\| `(\w+)\.py` \|.*\| `(\w+)\.py` \| \+(\d+) -(\d+) \|", re.MULTILINE)
# a table that samples a run's curve, after the command that prints it
MARKS_TABLE = re.compile(r"^`python plot\.py (\S+) --table ([^`]+)`:\n\n((?:\|.*\n)+)", re.MULTILINE)


def test_the_changed_lines_column_is_what_git_diff_counts():
    with open(os.path.join(REPO, "README.md")) as f:
        rows = ROW.findall(f.read())
    assert len(rows) == 5                      # every script but the two that start a chapter
    for script, against, added, removed in rows:
        numstat = subprocess.run(["git", "diff", "--no-index", "--numstat", f"{against}.py", f"{script}.py"],
                                 cwd=REPO, capture_output=True, text=True).stdout.split()
        assert numstat[:2] == [added, removed], script


def test_each_table_of_a_runs_curve_in_results_is_what_its_command_prints_from_the_committed_events():
    sys.path.insert(0, REPO)
    import plot
    with open(os.path.join(REPO, "docs", "RESULTS.md")) as f:
        tables = MARKS_TABLE.findall(f.read())
    assert len(tables) >= 12
    for run_dir, marks, table in tables:
        assert plot.marks_table(os.path.join(REPO, run_dir), [plot.mark(m) for m in marks.split()]) == table.strip()


def test_the_readme_stays_short_with_its_results_table_in_its_first_60_lines():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert len(text.split()) <= 1300           # about 10 minutes of reading
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
    documents = ["README.md"] + [os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "docs", "*.md"))
                                 + glob.glob(os.path.join(REPO, "docs", "notes", "*.md"))]
    for document in documents:
        with open(os.path.join(REPO, document)) as f:
            text = f.read()
        here = os.path.dirname(document)
        targets = [t for t in LINK.findall(text) if not t.startswith(("http://", "https://"))]
        targets += re.findall(r"docs/runs/[\w.-]+", text) if document == "README.md" else []   # play.py's folders
        for target in targets:
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(here, path)) if path else document
            assert os.path.exists(os.path.join(REPO, path)), f"{document}: {target}"
            assert not anchor or anchor in anchors(os.path.join(REPO, path)), f"{document}: {target}"


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
