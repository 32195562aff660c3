"""Text logs carry the date and milliseconds; JSON mode turns the ready line into a record."""

from __future__ import annotations

import json
import logging
import re

import pytest

from surge.log import announce, setup_logging, show_progress


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def test_text_lines_carry_date_and_milliseconds(capsys, restore_logging):
    setup_logging("info", False, "tester")
    logging.getLogger("surge.test").info("hello", extra={"request_id": "r1"})
    announce("surge ready on http://x", event="ready")
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} I \[tester\] hello "
                        r"request_id=r1", lines[0]), lines[0]
    assert lines[1] == "surge ready on http://x"


def test_json_mode_has_no_progress_and_a_ready_record(capsys, restore_logging):
    setup_logging("error", True, "supervisor")
    assert not show_progress()
    announce("surge ready on http://x", event="ready", url="http://x")  # whatever the level
    record = json.loads(capsys.readouterr().err)
    assert record["event"] == "ready" and record["url"] == "http://x"
    assert record["process"] == "supervisor" and record["msg"] == "surge ready on http://x"
