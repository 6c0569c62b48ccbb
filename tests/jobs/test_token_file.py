"""Ray's token file is a password: an embedded run leaves it readable by its owner only
(Ray itself writes it with the umask, 0644 on most hosts; issue 48)."""

from __future__ import annotations

import os
import stat

import pytest

from elastic.ray_join import private_token_file

pytestmark = pytest.mark.timeout(30)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_token_file_others_could_read_is_made_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("secret")
    token.chmod(0o644)
    private_token_file()
    assert _mode(token) == 0o600
    assert token.read_text() == "secret"


def test_no_token_file_and_a_symlinked_one_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    private_token_file()  # none: nothing to do, no error
    (tmp_path / ".ray").mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("x")
    target.chmod(0o644)
    (tmp_path / ".ray" / "auth_token").symlink_to(target)
    private_token_file()
    assert _mode(target) == 0o644  # a link is not followed to chmod what it points at
