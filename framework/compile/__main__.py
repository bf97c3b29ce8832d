"""`python -m framework.compile recipe=<name> target=<target> [key=value ...]`
(framework/compile/cli.py)."""

from framework.runtime import faults

faults.install_early_handlers()

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # first, so no JAX plugin prints to stderr (framework/runtime/quiet.py)

from framework.compile.cli import main  # noqa: E402

main()
