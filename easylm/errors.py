"""User-facing errors: one clear line, a non-zero exit, no traceback.

Anything the user can fix (a flag, a path, a preset name, a mesh shape) raises
`UserError` with a message that names the problem. Command-line entry points
wrap their main function in `exit_on_user_error`, which prints that one line
to stderr and exits with status 2. A missing optional package (torch for `.bin`
checkpoints, gcsfs for gs:// paths, ...) is the same kind of problem: one line
naming the package, what needed it, and how to install it. Bugs keep their
tracebacks.
"""

import functools
import os
import sys
import traceback

# How to install an optional package, by the name Python imports it as.
INSTALL = {
    "torch": 'install the torch extra: pip install -e ".[torch]" (for the CPU-only build, first '
             'pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)',
    "lm_eval": 'install the eval extra: pip install -e ".[eval]"',
    "tensorboardX": 'install the eval extra: pip install -e ".[eval]"',
    "matplotlib": 'install the eval extra: pip install -e ".[eval]"',
    "gcsfs": "pip install gcsfs",
    "s3fs": "pip install s3fs",
    "adlfs": "pip install adlfs",
}


class UserError(ValueError):
    """A problem with the user's input, reported as one line."""


def missing_package(error: BaseException) -> str | None:
    """The one-line message for an ImportError caused by a package that is not installed
    (directly, or wrapped as fsspec wraps gcsfs's), or None when it is not one (a bug)."""
    cause = error
    while cause is not None and not isinstance(cause, ModuleNotFoundError):
        cause = cause.__cause__ or cause.__context__
    if cause is None or not cause.name or cause.name.split(".")[0] == "easylm":
        return None
    package = cause.name.split(".")[0]
    package_dir = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(error.__traceback__)  # easylm's, not this file's
              if os.path.dirname(os.path.abspath(f.filename)).startswith(package_dir)
              and os.path.abspath(f.filename) != os.path.abspath(__file__)]
    where = ""
    if frames:
        where = f" (needed by {os.path.relpath(frames[-1].filename, os.path.dirname(package_dir))}" \
                f":{frames[-1].lineno})"
    return (f"the Python package {package!r} is not installed{where}; "
            f"{INSTALL.get(package, f'pip install {package}')}")


def exit_on_user_error(main):
    """Decorate a CLI main: a UserError (or a missing optional package) becomes
    `error: <message>` and exit 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            message = str(e)
        except ImportError as e:
            message = missing_package(e)
            if message is None:
                raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    return wrapped
