"""`python -m framework.generate checkpoint=<folder> prompt="..." [key=value ...]`:
text from a run, a checkpoint or a Hugging Face folder (framework/run/generate.py)."""

import sys

from framework.run.generate import main

if __name__ == "__main__":
    sys.exit(main())
