"""Issue 46, the front door as a newcomer finds it: the README's and docs' claims that a
fresh clone meets (Python version, test durations, the sweep's folder, a text run to
generate from), and the lines the main job ends with."""

import re
import tomllib

from framework.run.tracking import final_line
from tests.helpers import REPO


def test_python_version_is_the_one_jax_needs_everywhere():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    for page in ("README.md", "docs/running.md"):
        text = (REPO / page).read_text()
        assert "Python ≥ 3.11" in text and "3.10," not in text, page


def test_the_readme_says_how_long_and_what_the_fast_tier_and_aot_are():
    readme = (REPO / "README.md").read_text()
    assert "about 40 minutes" in readme and "about 400 MB" in readme
    assert 'python -m pytest -q -m "not e2e and not slow"' in readme


def test_the_readmes_sweep_names_the_folder_its_report_reads():
    readme = (REPO / "README.md").read_text()
    sweep = re.search(r"hydra\.sweep\.dir=(\S+)", readme).group(1)
    assert f"python tools/sweep_report.py {sweep}" in readme and "train.steps=20" in readme


def test_generation_is_introduced_on_a_run_trained_on_text():
    readme = (REPO / "README.md").read_text()
    text_run = re.search(r"data=text data.path=\S+ hydra.run.dir=(\S+)", readme).group(1)
    assert f"python -m framework.generate checkpoint={text_run}" in readme


def test_runs_folder_is_ignored_by_git():
    assert "runs/" in (REPO / ".gitignore").read_text().split()


def test_the_last_line_gives_eval_loss_against_the_floor():
    line = final_line({"status": "completed", "mesh_name": "pp2-dp2-tp2-mb4", "step": 150,
                       "train/loss": 3.9082, "eval/loss": 3.899,
                       "data/entropy_floor": 3.679})
    assert "eval/loss 3.8990 (+0.220 above the floor 3.679)" in line
    assert "floor" not in final_line({"status": "completed", "eval/loss": 4.0})
