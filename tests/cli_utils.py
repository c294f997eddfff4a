"""Shared by the command-line tests: a user error is one `error:` line and exit status 2."""

import pytest


def one_line_error(main, argv: list[str], capsys) -> str:
    """Run `main(argv)` expecting a user error; its message without `error: `."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err[len("error: "):-1]
