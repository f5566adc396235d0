"""Errors for people: a refusal reaches a command-line user as its message and exit code 1, not a traceback.

The suite refuses bad input on purpose, with a message that names the file, key or value and says what
to do: a ``ValueError`` (a bad value, a checkpoint of another task), an ``OSError`` (a missing or unreadable
file, a run root that is a file), or a :class:`Refusal` (a run root that holds another fit, absent weights,
a timm architecture that cannot do what was asked). On the command line such an error prints as

    error: <the message> [raised at tasks/cli/resume.py:271; SUITE_DEBUG=1 shows the traceback]

on standard error, and the command exits 1. The place it was raised stays in the line, and the environment
switch :data:`DEBUG_SWITCH` is named there, so an error that is a bug after all (a ``ValueError`` from deep
inside a library) is one switch away from its traceback, never lost. Any other exception (``TypeError``,
``KeyError``, ``RuntimeError``...) is a bug until shown otherwise: it keeps Python's full traceback.

The Python API (``tasks.run``, ``tasks.load``, the task classes) raises the exception itself; only the
entry points of the commands (``python -m tasks.<task>``, the tools, ``python -m datamodules.optimize``)
go through :func:`refusals_as_messages`.

Why these types rather than a marker class on every refusal: the suite's refusals are ``ValueError`` and
``OSError`` raised from many modules (and from the libraries it drives: Lightning's
``MisconfigurationException``), so a marker would have to reach every raise site; the ones that are neither
(``RunInUse``, ``WeightsUnavailable``, ``TimmRefusal``) derive from :class:`Refusal` or one of those types.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path
from typing import Iterator

#: the environment variable that shows the traceback of a refusal (any value but ``""`` and ``"0"``)
DEBUG_SWITCH = "SUITE_DEBUG"

REPO = Path(__file__).resolve().parents[1]


class Refusal(Exception):
    """A deliberate refusal that is neither a ``ValueError`` nor an ``OSError`` (a run root in use by
    another fit): the command line shows its message alone."""


def refusal_types() -> tuple[type[BaseException], ...]:
    """The exception types a command shows as a message (see the module)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return ValueError, OSError, Refusal, MisconfigurationException


def debugging() -> bool:
    return os.environ.get(DEBUG_SWITCH, "") not in ("", "0")


def _raising_file(err: BaseException) -> tuple[Path, int] | None:
    frames = traceback.extract_tb(err.__traceback__)
    return (Path(frames[-1].filename).resolve(), frames[-1].lineno) if frames else None


def _in_repo(path: Path) -> bool:
    return path.is_relative_to(REPO) and "site-packages" not in path.parts


def origin(err: BaseException) -> BaseException:
    """The refusal the suite wrote: a library's wrapper of it (jsonargparse re-raises an error from a class's
    ``__init__`` as "Does not validate against any of the Union subtypes", with the whole config) is unwrapped
    to its cause, while the cause is itself a refusal."""
    while isinstance(err.__cause__, refusal_types()):
        raised = _raising_file(err)
        if raised is not None and _in_repo(raised[0]):
            break
        err = err.__cause__
    return err


def where_raised(err: BaseException) -> str:
    """``path:line`` of the innermost frame of ``err``'s traceback, relative to the repository when inside it."""
    raised = _raising_file(err)
    if raised is None:
        return "?"
    path, line = raised
    return f"{path.relative_to(REPO) if _in_repo(path) else path}:{line}"


def message_line(err: BaseException) -> str:
    """What a command prints for a refusal: ``error: <message> [raised at <where>; SUITE_DEBUG=1 shows the
    traceback]``, the message the suite wrote (:func:`origin`)."""
    err = origin(err)
    text = str(err) or type(err).__name__
    return f"error: {text} [raised at {where_raised(err)}; {DEBUG_SWITCH}=1 shows the traceback]"


@contextlib.contextmanager
def refusals_as_messages() -> Iterator[None]:
    """Around a command's work: a refusal (:func:`refusal_types`) exits 1 with :func:`message_line` on
    standard error, unless :data:`DEBUG_SWITCH` is set, when it propagates with its traceback. Other
    exceptions, ``SystemExit`` and ``KeyboardInterrupt`` pass through unchanged."""
    try:
        yield
    except refusal_types() as err:
        if debugging():
            raise
        sys.stdout.flush()
        print(message_line(err), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
