"""The one user-error type. The CLI catches it at the top and maps it to an exit code."""

from __future__ import annotations


class IpwError(Exception):
    """A problem the user can fix (bad input, missing file, missing extra). Exit code 2 by default.

    The message is one line that names the file, line and field where they are known.
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def where(path: object, line: int | None = None, field: str | None = None) -> str:
    """Format a location prefix such as ``data.jsonl:12: field 'answer'``."""
    out = str(path)
    if line is not None:
        out += f":{line}"
    if field is not None:
        out += f": field '{field}'"
    return out


def missing_extra(module: str, extra: str) -> IpwError:
    return IpwError(
        f"{module} is not installed; install it with: pip install 'ipw[{extra}]'"
    )


class ParameterError(IpwError):
    """A bad argument of a library function, named as the function names it: ``n_boot 0: must be at least 1``,
    ``backend 'a' is given both local and cloud``.  The library takes parameters, not flags (issue 57): the
    CLI, whose flag set the value, re-raises it naming the flag instead (``named``; ``ipw.options.naming_flags``).

    ``parameters``: the names, joined by " and " between ``before`` and ``detail``.
    """

    def __init__(self, parameters: tuple[str, ...], detail: str, before: str = "") -> None:
        super().__init__(before + " and ".join(parameters) + detail)
        self.parameters = parameters
        self.detail = detail
        self.before = before

    def named(self, names: dict[str, str]) -> IpwError:
        """The same error with each parameter as ``names`` calls it (one not in ``names``: as it is)."""
        return IpwError(self.before + " and ".join(names.get(p, p) for p in self.parameters) + self.detail,
                        self.exit_code)
