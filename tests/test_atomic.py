"""util/atomic.py: a write is all or nothing, and never replaces what is not a regular file."""

import os

import pytest

from util.atomic import atomic_write, write_text


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "out.txt"
    write_text(path, "old")

    def dies(f):
        f.write("half of the new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, dies)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]
    write_text(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.txt"]


@pytest.mark.parametrize("kind", ["directory", "pipe"])
def test_a_path_that_is_not_a_regular_file_is_refused_untouched(tmp_path, kind):
    path = tmp_path / "target"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(ValueError, match="not a regular file"):
        write_text(path, "text")
    assert path.is_dir() if kind == "directory" else path.is_fifo()
    assert not (tmp_path / "target.tmp").exists()
