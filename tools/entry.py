"""How the data tools (prepare_data, train_tokenizer, export_hf) end: every failure is
one line `error: ...` on stderr and an exit status (docs/data.md):

    2    bad input: an argument, a setting, an input file that cannot be read or parsed
    4    an output could not be written (no space left, quota)
    130  interrupted (Ctrl-C); what was being written is not left half done
    1    anything else (a worker process that died, a bug), still in one line

Argument errors are one line too, without argparse's usage block (`Parser`).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from framework.errors import ConfigError, DataError, StorageError

BAD_INPUT, NO_SPACE, INTERRUPTED, FAILED = 2, 4, 130, 1
FULL = (errno.ENOSPC, errno.EDQUOT)


class Parser(argparse.ArgumentParser):
    """argparse with each argument error as a ConfigError (one line, no usage block)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (python {self.prog} --help lists the arguments)")


def positive_int(flag: str) -> Callable[[str], int]:
    """An argparse type: an integer >= 1, else a one-line error naming `flag`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} {value} must be >= 1")
        return value
    return parse


def os_error_line(err: OSError) -> tuple[str, int]:
    """(the line, the exit status) of an OSError that reached a tool's entry point."""
    where = f" {err.filename}" if err.filename else ""
    if err.errno in FULL:
        return (f"no space left writing{where} ({err.strerror}): free space or choose "
                f"an output on another disk; nothing half-written was kept", NO_SPACE)
    return f"cannot use{where}: {err.strerror or err}", BAD_INPUT


def run(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> int:
    """Calls `main(argv)`; returns its exit status, having printed any failure as one
    line (module docstring)."""
    try:
        main(argv)
        return 0
    except (ConfigError, DataError) as err:
        line, status = str(err), BAD_INPUT
    except StorageError as err:
        line, status = str(err), NO_SPACE
    except KeyboardInterrupt:
        line, status = ("interrupted: nothing was left half-written; run the command "
                        "again to finish"), INTERRUPTED
    except OSError as err:
        line, status = os_error_line(err)
    except BrokenProcessPool:
        line, status = ("a worker process died (killed, or out of memory): nothing of its "
                        "input was kept; run the command again"), FAILED
    except Exception as err:  # a bug: still one line, the traceback on request
        if os.environ.get("FRAMEWORK_TRACEBACK") == "1":
            raise
        line, status = (f"unexpected {type(err).__name__}: {err} (a bug; "
                        f"FRAMEWORK_TRACEBACK=1 shows where)"), FAILED
    print(f"error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    return status
