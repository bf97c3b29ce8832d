"""`python -m framework.generate checkpoint=<folder> prompt="..." [key=value ...]`:
text from a run, a checkpoint or a Hugging Face folder (framework/run/generate.py)."""

import sys

from framework.runtime.quiet import import_jax

import_jax()  # first, so no JAX plugin prints to stderr (framework/runtime/quiet.py)

from framework.run.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
