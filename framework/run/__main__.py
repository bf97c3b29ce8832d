"""`python -m framework.run recipe=<name> [key=value ...]`: train (framework/run/cli.py)."""

from framework.runtime import faults

faults.install_early_handlers()

from framework.runtime.quiet import import_jax  # noqa: E402

import_jax()  # first, so no JAX plugin prints to stderr (framework/runtime/quiet.py)  # SIGTERM/SIGINT from the first instant, before Hydra and JAX

from framework.run.cli import main  # noqa: E402

main()
