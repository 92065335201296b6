"""The one error type library code raises; the CLI turns it into one line on stderr."""


class TfmError(Exception):
    """A problem the user can fix. ``exit_code`` 1 = runtime error, 2 = usage error."""

    exit_code = 1


class UsageError(TfmError):
    exit_code = 2


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (or its type), for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def cause_line(e: BaseException) -> str:
    """first_line of `e`, followed by its innermost cause's when that one says something else: wrapped
    errors (e.g. datasets' "An error occurred while generating the dataset") say what happened only
    in their cause."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    outer, inner = first_line(e), first_line(root)
    return outer if root is e or inner in outer else f"{outer}: {inner}"
