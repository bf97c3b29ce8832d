"""The documentation keeps up with the code: every configuration key is on the
configuration page, and the README's test command is what CI runs."""

import re

from framework.config import GenerateConfig, RunConfig, setting_names
from tests.helpers import REPO


keys = setting_names


def test_every_configuration_key_is_on_the_configuration_page():
    page = (REPO / "docs" / "configuration.md").read_text()
    named = set(re.findall(r"`([a-z_][\w.]*)`", page))
    missing = [k for k in keys(RunConfig) if k not in named]
    assert missing == [], f"docs/configuration.md lacks {missing}"
    assert len(keys(RunConfig)) > 60  # the walk reaches the nested groups
    generate = [k for k in keys(GenerateConfig) if k not in named]
    assert generate == [], f"docs/configuration.md lacks the generate settings {generate}"


def test_the_readme_test_command_is_what_ci_runs():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    command = "pip install -e '.[test,aot]' && python -m pytest -q"
    assert command in readme and command in ci
    assert "pip install -e . && python -m framework.run recipe=llama_small_3d" in readme
