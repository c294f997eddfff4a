"""User-facing errors: one clear line, a non-zero exit, no traceback.

Anything the user can fix (a flag, a path, a preset name, a mesh shape) raises
`UserError` with a message that names the problem. Command-line entry points
wrap their main function in `exit_on_user_error`, which prints that one line
to stderr and exits with status 2. Bugs keep their tracebacks.
"""

import functools
import sys


class UserError(ValueError):
    """A problem with the user's input, reported as one line."""


def exit_on_user_error(main):
    """Decorate a CLI main: a UserError becomes `error: <message>` and exit 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapped
