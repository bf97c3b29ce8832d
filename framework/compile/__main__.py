"""`python -m framework.compile recipe=<name> target=<target> [key=value ...]`
(framework/compile/cli.py)."""

from framework.runtime import faults

faults.install_early_handlers()

from framework.compile.cli import main  # noqa: E402

main()
