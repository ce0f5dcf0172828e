"""What the README says of the code, checked against it."""
import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| `(\w+)\.py` \|.*\| `(\w+)\.py` \| \+(\d+) -(\d+) \|", re.MULTILINE)


def test_the_changed_lines_column_is_what_git_diff_counts():
    with open(os.path.join(REPO, "README.md")) as f:
        rows = ROW.findall(f.read())
    assert len(rows) == 5                      # every script but the two that start a chapter
    for script, against, added, removed in rows:
        numstat = subprocess.run(["git", "diff", "--no-index", "--numstat", f"{against}.py", f"{script}.py"],
                                 cwd=REPO, capture_output=True, text=True).stdout.split()
        assert numstat[:2] == [added, removed], script


def test_the_readme_stays_short_with_its_results_table_in_its_first_60_lines():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert len(text.split()) <= 1300           # about 10 minutes of reading
    assert "| script | 2-core CPU, fp32 |" in "\n".join(text.splitlines()[:60])
