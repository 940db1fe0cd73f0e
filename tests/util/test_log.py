"""The library logger: silent by default, never configures structlog, stdlib-rendered."""

from __future__ import annotations

import logging

import pytest
import structlog

from agentspec._util.log import LOGGER_NAME, get_logger


def test_silent_by_default_and_structlog_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    """Without an application handler nothing is printed, and structlog stays unconfigured."""
    get_logger().warning("agentspec-test-event", stage="SQL")
    out = capsys.readouterr()
    assert "agentspec-test-event" not in out.out + out.err
    assert not structlog.is_configured()


def test_records_reach_the_application_with_bound_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a handler on "agentspec", records carry event fields and contextvars."""
    with (
        caplog.at_level(logging.INFO, logger=LOGGER_NAME),
        structlog.contextvars.bound_contextvars(session_id="s-1"),
    ):
        get_logger().info("learned", stage="SQL", tokens=12)
        get_logger().debug("below the level")
    records = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert [r.getMessage() for r in records] == ["learned"]
    assert records[0].stage == "SQL"  # type: ignore[attr-defined]
    assert records[0].tokens == 12  # type: ignore[attr-defined]
    assert records[0].session_id == "s-1"  # type: ignore[attr-defined]


def test_fields_named_like_logrecord_attributes_are_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``message=`` (a LogRecord attribute) once made makeRecord raise KeyError."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        get_logger().debug("agentspec-test", message="m", name="n", args="a", line="l")
    (rec,) = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert rec.getMessage() == "agentspec-test"
    assert (rec.message_, rec.name_, rec.args_, rec.line) == ("m", "n", "a", "l")
