"""One line for what a user can fix: a UserError, or an optional package that is missing."""

import importlib.util

import pytest

from easylm.errors import UserError, exit_on_user_error


def run(main, capsys):
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(main)()
    return exit_info.value.code, capsys.readouterr().err


def test_user_error_is_one_line(capsys):
    def main():
        raise UserError("--port=x: not a number")

    assert run(main, capsys) == (2, "error: --port=x: not a number\n")


def test_missing_optional_package_names_it_and_how_to_install_it(capsys):
    def main():
        import torch_that_is_not_installed  # noqa: F401

    code, err = run(main, capsys)
    assert code == 2 and err.count("\n") == 1
    assert err == ("error: the Python package 'torch_that_is_not_installed' is not installed; "
                   "pip install torch_that_is_not_installed\n")


def test_missing_torch_names_its_extra(capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # as if not installed

    def main():
        import torch  # noqa: F401

    code, err = run(main, capsys)
    assert code == 2 and 'pip install -e ".[torch]"' in err and "torch==2.13.0" in err


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_gs_path_without_gcsfs_is_one_line(capsys):
    """fsspec wraps the missing gcsfs in an ImportError of its own."""
    from easylm.data import preview

    with pytest.raises(SystemExit) as exit_info:
        preview.main(["preview", "--train_dataset.json_dataset.path=gs://bucket/x.jsonl"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "'gcsfs' is not installed (needed by easylm/data/" in err and "pip install gcsfs" in err


def test_a_broken_import_inside_easylm_keeps_its_traceback():
    def main():
        import easylm.no_such_module  # noqa: F401

    with pytest.raises(ModuleNotFoundError):
        exit_on_user_error(main)()
