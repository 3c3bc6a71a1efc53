import pytest

from hpdl import cli


def test_help_lists_groups_without_importing_them(monkeypatch, capsys):
    monkeypatch.setitem(cli.GROUPS, "ghost", ("hpdl_no_such_module.cli:Ghost", "a group whose deps are missing", "ghost"))
    assert cli.main([]) == 1
    out = capsys.readouterr().out
    assert "ghost" in out and "bench" in out


def test_group_with_missing_dependency_gives_install_hint(monkeypatch, capsys):
    monkeypatch.setitem(cli.GROUPS, "ghost", ("hpdl_no_such_module.cli:Ghost", "a group whose deps are missing", "ghost"))
    assert cli.main(["ghost", "run"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'hpdl[ghost]'" in err and "hpdl_no_such_module" in err
    # the other groups still work
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0


def test_hpo_status_of_a_missing_store_says_so_and_creates_nothing(tmp_path, capsys):
    from hpdl.cli import main

    url = f"sqlite:///{tmp_path}/nowhere/study.db"
    assert main(["hpo", "status", "--storage", url, "--study", "x"]) != 0
    assert "no study store at" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
