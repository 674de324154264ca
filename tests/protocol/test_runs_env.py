"""What a run's status and tags may be, and where a client finds the service."""

from __future__ import annotations

import pytest

from fp8_protocol.env import env_token, service_url
from fp8_protocol.runs import FINAL_STATUSES, MAX_TAGS, RUN_STATUSES, check_tags


def test_every_status_but_running_is_final():
    assert RUN_STATUSES[0] == "running"
    assert set(FINAL_STATUSES) == set(RUN_STATUSES) - {"running"}


def test_tags_come_back_sorted_once_each_and_a_bad_one_is_named():
    assert check_tags(["b", "a", "lr=3e-4", "a"]) == ["a", "b", "lr=3e-4"]
    with pytest.raises(ValueError, match="'has space' is not a tag"):
        check_tags(["ok", "has space"])
    with pytest.raises(ValueError, match="expected a list"):
        check_tags("one")
    with pytest.raises(ValueError, match=f"at most {MAX_TAGS}"):
        check_tags([f"t{i}" for i in range(MAX_TAGS + 1)])


def test_service_url_takes_the_argument_then_the_environment(monkeypatch):
    monkeypatch.setenv("FP8SCOPE_URL", "http://envhost:9")
    assert service_url("https://a.example:8000") == "https://a.example:8000"
    assert service_url(None) == "http://envhost:9"
    with pytest.raises(ValueError, match="service root"):
        service_url("a.example:8000")


def test_token_from_the_environment_then_from_its_file(monkeypatch, tmp_path):
    monkeypatch.delenv("FP8SCOPE_TOKEN", raising=False)
    monkeypatch.delenv("FP8SCOPE_TOKEN_FILE", raising=False)
    assert env_token() is None
    path = tmp_path / "token"
    path.write_text("secret-from-file\nignored\n")
    monkeypatch.setenv("FP8SCOPE_TOKEN_FILE", str(path))
    assert env_token() == "secret-from-file"
    monkeypatch.setenv("FP8SCOPE_TOKEN", "direct")
    assert env_token() == "direct"
    monkeypatch.delenv("FP8SCOPE_TOKEN")
    monkeypatch.setenv("FP8SCOPE_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read"):
        env_token()
