"""Research commands refuse to overwrite files git tracks unless asked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from acache.cli import main
from acache_lab.tracked import refuse_tracked, tracked_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "plot.png").write_bytes(b"x")
    (tmp_path / "docs" / "scratch.png").write_bytes(b"y")
    subprocess.run(["git", "add", "docs/plot.png"], cwd=tmp_path, check=True)
    return tmp_path


def test_tracked_files_and_directories_are_refused(repo):
    assert tracked_files(repo / "docs" / "plot.png") == ["plot.png"]
    for path in (repo / "docs" / "plot.png", repo / "docs"):
        with pytest.raises(ValueError, match="tracked by git .*plot.png.*--overwrite"):
            refuse_tracked([path], overwrite=False)
    refuse_tracked([repo / "docs" / "plot.png"], overwrite=True)


def test_untracked_new_and_outside_paths_pass(repo, tmp_path_factory):
    refuse_tracked([repo / "docs" / "scratch.png", repo / "new" / "deep" / "out.json", None], overwrite=False)
    outside = tmp_path_factory.mktemp("no-repo")
    refuse_tracked([outside / "a.png"], overwrite=False)


def test_a_command_pointed_at_a_tracked_file_stops_before_any_work(capsys):
    before = (ROOT / "README.md").read_bytes()
    assert main(["eval", "tasks", "--json", str(ROOT / "README.md"), "--examples", "1"]) == 2
    err = capsys.readouterr().err
    assert "README.md would overwrite files tracked by git" in err and "--overwrite" in err
    assert (ROOT / "README.md").read_bytes() == before
    assert main(["bench", "--plot", str(ROOT / "docs"), "--batch-sizes", "1"]) == 2
    assert "tracked by git" in capsys.readouterr().err


def test_a_checkpoint_folder_must_be_empty_unless_overwritten(tmp_path):
    from acache_lab.tracked import refuse_full_dir

    refuse_full_dir(tmp_path / "absent", overwrite=False)  # nothing there: fine
    (tmp_path / "empty").mkdir()
    refuse_full_dir(tmp_path / "empty", overwrite=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="full exists and is not empty"):
        refuse_full_dir(tmp_path / "full", overwrite=False)
    refuse_full_dir(tmp_path / "full", overwrite=True)
    (tmp_path / "file").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(NotADirectoryError, match="file is a file, not a directory"):
            refuse_full_dir(tmp_path / "file", overwrite=overwrite)
