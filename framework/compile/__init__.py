"""Ahead-of-time compilation for clusters this machine is not: `python -m framework.compile
recipe=<recipe> target=<target>` (docs/compile.md). targets.py names the clusters,
program.py compiles the run's step for one and reads the compiler's figures, report.py
prints and writes them, cli.py is the command line."""
