"""One error path for every entry point: a failure the user can act on is one paragraph and an exit status,
never a Python traceback.

* exit **2**, bad input: a flag, or a file we were pointed at that is malformed, refused or of another shape
  (``ValueError`` and its subclasses, ``SafetensorError``, ``pickle.UnpicklingError``, ``json`` errors, a
  path that does not exist or cannot be opened for reading, ``InputFileError``).
* exit **1**, environment: the disk is full, the mount is read-only, a file is larger than the process may
  write, an I/O error, a background writer failed (any other ``OSError``, ``EnvironmentFailure``) -- and any
  exception that carries ``exit_status = 1`` (the training loop's ``TrainingError``).

Anything else is a programming error and keeps its traceback. ``--debug`` prints the traceback of the
handled ones too.
"""
from __future__ import annotations

import errno as errno_module
import os
import pickle
import sys
import traceback
from typing import Callable, NoReturn, Optional, Sequence

_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class InputFileError(ValueError):
    """A file we were asked to read is malformed, refused or does not fit the run (exit 2)."""


class EnvironmentFailure(RuntimeError):
    """The machine failed the run: disk full, read-only mount, I/O error, a failed writer (exit 1)."""

    exit_status = 1


def errno_name(error: BaseException) -> str:
    """``"ENOSPC (No space left on device)"`` for an OSError with an errno, else ``""``."""
    number = getattr(error, "errno", None)
    if not isinstance(number, int):
        return ""
    return f"{errno_module.errorcode.get(number, str(number))} ({os.strerror(number)})"


def describe_os_error(error: OSError) -> str:
    """``"/path: ENOSPC (No space left on device)"``: the file and the errno by name."""
    name = errno_name(error) or str(error)
    path = error.filename if error.filename is not None else ""
    if error.filename2 is not None:
        path = f"{path} -> {error.filename2}"
    return f"{path}: {name}" if path else name


def exit_status_of(error: BaseException) -> Optional[int]:
    """2 for bad input, 1 for the environment, None for a programming error (keep its traceback)."""
    status = getattr(error, "exit_status", None)
    if isinstance(status, int):
        return status
    if isinstance(error, (ValueError, pickle.UnpicklingError, InputFileError, *_PATH_ERRORS)):
        return 2  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
    if _is_safetensor_error(error):
        return 2
    if isinstance(error, OSError):
        return 1
    return None


def _is_safetensor_error(error: BaseException) -> bool:
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return False
    return isinstance(error, SafetensorError)


def describe(error: BaseException) -> str:
    """One paragraph: the message, with the file and errno of an OSError, and the type of an unpickling or
    safetensors failure (whose own messages do not say what failed)."""
    if isinstance(error, OSError) and error.errno is not None:
        return describe_os_error(error)
    if isinstance(error, pickle.UnpicklingError) or _is_safetensor_error(error):
        return f"{type(error).__name__}: {error}"
    text = str(error) or type(error).__name__
    return " ".join(text.split("\n"))


def report_and_exit(prog: str, error: BaseException, *, debug: bool = False,
                    status: Optional[int] = None) -> NoReturn:
    """Prints ``<prog>: error: <one paragraph>`` on stderr (with the traceback under ``debug``) and exits."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    print(f"{prog}: error: {describe(error)}", file=sys.stderr, flush=True)
    raise SystemExit(status if status is not None else (exit_status_of(error) or 1))


def run_entry_point(prog: str, body: Callable[[], Optional[int]], *, debug: bool = False) -> int:
    """Runs ``body()``; a handled failure becomes ``report_and_exit`` (status 2 or 1), a programming error
    propagates with its traceback. Returns ``body()``'s status (0 for None)."""
    try:
        return body() or 0
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - classified below; the rest re-raised
        if exit_status_of(error) is None:
            raise
        report_and_exit(prog, error, debug=debug)


def run_tool(prog: str, run: Callable[[Optional[Sequence[str]]], Optional[int]],
             argv: Optional[Sequence[str]] = None) -> int:
    """A tool's ``main(argv)``: ``run_entry_point`` of ``run(argv)`` whose exit status is returned rather than
    raised (argparse's and ``report_and_exit``'s), so in-process callers get 0, 1 or 2."""
    try:
        return run_entry_point(prog, lambda: run(argv), debug=debug_requested(argv))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)


def debug_requested(argv) -> bool:
    """Whether ``--debug`` is among the command-line arguments (checked before parsing: a parse failure is
    reported too)."""
    return "--debug" in (sys.argv[1:] if argv is None else list(argv))


__all__ = ["InputFileError", "EnvironmentFailure", "errno_name", "describe_os_error", "exit_status_of", "describe",
           "report_and_exit", "run_entry_point", "run_tool", "debug_requested"]
