"""Tests of agentspec.traces: the conversation trace format, its reader and writers."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from prereq import require_shared, shared

from agentspec.exceptions import AgentSpecError, InvalidArgumentError
from agentspec.traces import (
    Message,
    TraceFormatError,
    TraceRecord,
    TraceRequest,
    TraceWriter,
    iter_requests,
    read_traces,
    write_traces,
)

TRACES = shared("traces")
SPIDER = TRACES / "spider-sql.dev.jsonl.gz"
SWE = TRACES / "swe-gemini3pro.dev.jsonl.gz"


def _records() -> list[TraceRecord]:
    return [
        TraceRecord(
            "w",
            "s-unicode",
            "chat",
            (
                Message("system", "Sys  with trailing space \n"),
                Message("user", 'héllo 世界 😀 \u2028 tab\t nul\x00 quote" back\\slash'),
                Message("assistant", "réponse ✓\r\n"),
            ),
            {},
        ),
        TraceRecord(
            "w",
            "s-stages",
            "sql",
            (
                Message("system", "S"),
                Message("user", "Q"),
                Message("assistant", "A1", stage="sql-a"),
                Message("user", "again"),
                Message("assistant", "A2"),
                Message("user", "more"),
                Message("assistant", "A3", stage="sql-c"),
            ),
            {"z": 1, "a": [1.5, None, True], "m": {"k": "v", "b": "é"}},
        ),
    ]


def _write_lines(path: Path, lines: list[str], *, gz: bool = False) -> None:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    path.write_bytes(gzip.compress(data) if gz else data)


def _good_line(session: str = "s0") -> str:
    return json.dumps(
        {
            "workload": "w",
            "session": session,
            "stage": "st",
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "meta": {},
        }
    )


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip_hand_built_records(tmp_path: Path, name: str) -> None:
    """Records written and read back are equal, for plain and gzip files."""
    path = tmp_path / name
    recs = _records()
    assert write_traces(path, recs) == len(recs)
    back = list(read_traces(path))
    assert back == recs
    assert [list(r.meta) for r in back] == [list(r.meta) for r in recs]  # key order kept


def test_written_lines_are_plain_json_in_schema_key_order(tmp_path: Path) -> None:
    """A plain file holds json.dumps(..., ensure_ascii=False) lines, keys in schema order."""
    path = tmp_path / "t.jsonl"
    write_traces(path, _records())
    lines = path.read_bytes().decode("utf-8").split("\n")
    assert lines[-1] == ""
    first = json.loads(lines[0])
    assert list(first) == ["workload", "session", "stage", "messages", "meta"]
    assert "世界" in lines[0]  # not \u-escaped
    second = json.loads(lines[1])
    assert second["messages"][2] == {"role": "assistant", "content": "A1", "stage": "sql-a"}
    assert list(second["messages"][1]) == ["role", "content"]  # no stage key when unset
    assert lines[1] == json.dumps(second, ensure_ascii=False)


def test_lone_surrogate_survives_round_trip(tmp_path: Path) -> None:
    """Text UTF-8 cannot carry (a lone surrogate) is written escaped and read back unchanged."""
    rec = TraceRecord("w", "s", "st", (Message("user", "x\ud800y"), Message("assistant", "z")))
    path = tmp_path / "t.jsonl"
    write_traces(path, [rec])
    assert list(read_traces(path)) == [rec]


@pytest.mark.parametrize("trace", [SPIDER, SWE], ids=["spider", "swe"])
def test_real_trace_file_round_trips_byte_for_byte(tmp_path: Path, trace: Path) -> None:
    """Reading a shipped trace and writing it back reproduces its decompressed bytes."""
    require_shared(trace)
    out = tmp_path / "copy.jsonl"
    n = write_traces(out, read_traces(trace))
    original = gzip.decompress(trace.read_bytes())
    assert n == original.count(b"\n")
    assert out.read_bytes() == original


def test_gzip_is_detected_by_magic_bytes(tmp_path: Path) -> None:
    """A gzip file without a .gz name is still read as gzip."""
    path = tmp_path / "traces.jsonl"
    _write_lines(path, [_good_line()], gz=True)
    assert [r.session for r in read_traces(path)] == ["s0"]


def test_max_sessions_limits_and_is_checked(tmp_path: Path) -> None:
    """max_sessions stops early; values below 1 or non-ints raise InvalidArgumentError."""
    path = tmp_path / "t.jsonl"
    _write_lines(path, [_good_line(f"s{i}") for i in range(5)])
    assert [r.session for r in read_traces(path, max_sessions=2)] == ["s0", "s1"]
    assert [r.session for r in read_traces(path, max_sessions=np.int32(2))] == ["s0", "s1"]
    assert len(list(read_traces(path))) == 5
    for bad in (0, -1, True, 1.5, np.True_, np.int64(0)):
        with pytest.raises(InvalidArgumentError, match="max_sessions"):
            read_traces(path, max_sessions=bad)  # type: ignore[arg-type]


def test_empty_file_has_no_records(tmp_path: Path) -> None:
    """An empty file (as a fresh TraceWriter leaves it) yields no record."""
    for name in ("e.jsonl", "e.jsonl.gz"):
        (tmp_path / name).write_bytes(b"")
        assert list(read_traces(tmp_path / name)) == []


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    """A path that does not exist raises FileNotFoundError at the call."""
    with pytest.raises(FileNotFoundError, match="nope"):
        read_traces(tmp_path / "nope.jsonl")


_BASE = json.loads(_good_line())


def _with(**changes: object) -> str:
    obj = dict(_BASE)
    obj.update(changes)
    return json.dumps(obj)


def _without(key: str) -> str:
    return json.dumps({k: v for k, v in _BASE.items() if k != key})


BAD_LINES = {
    "bad JSON": ('{"workload": "w", "session": ', "invalid JSON"),
    "not an object": ("[1, 2]", "must be a JSON object, got array"),
    "missing key": (_without("meta"), r"missing key\(s\) \['meta'\]"),
    "unknown key": (_with(extra=1), r"unknown key\(s\) \['extra'\]"),
    "bad role": (
        _with(messages=[{"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}]),
        r"messages\[0\]: role 'tool' is not one of",
    ),
    "no assistant message": (
        _with(messages=[{"role": "user", "content": "q"}]),
        "no assistant message",
    ),
    "empty assistant message": (
        _with(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]),
        r"messages\[1\] is an empty assistant message",
    ),
    "message missing content": (
        _with(messages=[{"role": "assistant"}]),
        r"messages\[0\] is missing key 'content'",
    ),
    "message unknown key": (
        _with(messages=[{"role": "assistant", "content": "a", "name": "x"}]),
        r"messages\[0\] has unknown key\(s\) \['name'\]",
    ),
    "content not a string": (
        _with(messages=[{"role": "assistant", "content": 5}]),
        "content must be a string, got int",
    ),
    "stage not a string": (
        _with(messages=[{"role": "assistant", "content": "a", "stage": 1}]),
        "stage must be a string",
    ),
    "messages not a list": (_with(messages={"role": "user"}), "messages must be a JSON array"),
    "meta not an object": (_with(meta=[]), "meta must be a JSON object, got array"),
    "session not a string": (_with(session=7), "session must be a string, got int"),
    "duplicate JSON key": (
        '{"workload": "w", "workload": "v", "session": "s9", "stage": "x", '
        '"messages": [], "meta": {}}',
        "duplicate key 'workload'",
    ),
    "empty line": ("", "empty line"),
    "duplicate session": (_good_line("s0"), "session 's0' was already used on line 1"),
}


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_malformed_line_names_file_and_line(tmp_path: Path, case: str, gz: bool) -> None:
    """Each kind of bad line raises TraceFormatError starting with file:line (line 2 here)."""
    line, pattern = BAD_LINES[case]
    path = tmp_path / ("t.jsonl.gz" if gz else "t.jsonl")
    _write_lines(path, [_good_line("s0"), line, _good_line("s1")], gz=gz)
    it = read_traces(path)
    assert next(it).session == "s0"  # the good first record is still delivered
    with pytest.raises(TraceFormatError, match=pattern) as info:
        next(it)
    assert str(info.value).startswith(f"{path}:2: ")
    assert (info.value.path, info.value.line) == (str(path), 2)


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 raise TraceFormatError naming their line."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(_good_line().encode() + b"\n" + b'{"x": "\xff"}\n')
    with pytest.raises(TraceFormatError, match="invalid UTF-8") as info:
        list(read_traces(path))
    assert info.value.line == 2


def test_truncated_gzip_raises_after_the_complete_records(tmp_path: Path) -> None:
    """A cut gzip stream yields its whole lines, then raises naming the next line."""
    path = tmp_path / "t.jsonl.gz"
    data = gzip.compress(("\n".join(_good_line(f"s{i}") for i in range(50)) + "\n").encode())
    path.write_bytes(data[: len(data) - 20])
    got: list[str] = []
    with pytest.raises(TraceFormatError, match="cannot decompress") as info:
        got.extend(r.session for r in read_traces(path))
    assert len(got) >= 1
    assert info.value.line == len(got) + 1


def test_gz_name_with_plain_content_is_an_error(tmp_path: Path) -> None:
    """A .gz file that is not gzip raises TraceFormatError, not a crash."""
    path = tmp_path / "t.jsonl.gz"
    _write_lines(path, [_good_line()])
    with pytest.raises(TraceFormatError, match=r":1: cannot decompress"):
        list(read_traces(path))


def test_trace_format_error_is_agentspec_and_value_error() -> None:
    """TraceFormatError is catchable as AgentSpecError and as ValueError."""
    assert issubclass(TraceFormatError, AgentSpecError)
    assert issubclass(TraceFormatError, ValueError)
    err = TraceFormatError("bad", path="f.jsonl", line=3)
    assert str(err) == "f.jsonl:3: bad"
    assert TraceFormatError("bad").path is None


def test_iter_requests_gives_prompts_turns_and_stages() -> None:
    """One request per assistant message: earlier messages as prompt, message stage wins."""
    recs = _records()
    reqs = list(iter_requests(recs))
    assert [(r.session, r.turn, r.stage) for r in reqs] == [
        ("s-unicode", 2, "chat"),
        ("s-stages", 2, "sql-a"),
        ("s-stages", 4, "sql"),
        ("s-stages", 6, "sql-c"),
    ]
    stages = recs[1].messages
    assert reqs[2] == TraceRequest("w", "s-stages", 4, "sql", stages[:4], "A2")
    assert [m.content for m in reqs[3].prompt] == ["S", "Q", "A1", "again", "A2", "more"]
    assert reqs[0].response == "réponse ✓\r\n"


def test_record_constructor_checks_and_coerces() -> None:
    """TraceRecord stores messages as a tuple and rejects off-format fields."""
    rec = TraceRecord("w", "s", "st", [Message("assistant", "a")])  # type: ignore[arg-type]
    assert rec.messages == (Message("assistant", "a"),)
    assert rec.meta == {}
    same_but_meta = TraceRecord("w", "s", "st", rec.messages, {"k": [1]})
    assert hash(same_but_meta) == hash(rec)
    assert same_but_meta != rec
    with pytest.raises(TraceFormatError, match="no assistant message"):
        TraceRecord("w", "s", "st", (Message("user", "q"),))
    with pytest.raises(TraceFormatError, match="not a Message"):
        TraceRecord("w", "s", "st", ({"role": "assistant", "content": "a"},))  # type: ignore[arg-type]
    with pytest.raises(TraceFormatError, match="meta must be a dict"):
        TraceRecord("w", "s", "st", (Message("assistant", "a"),), [])  # type: ignore[arg-type]
    with pytest.raises(TraceFormatError, match="role 'bot'"):
        Message("bot", "x")


def test_write_traces_rejects_duplicates_and_leaves_no_file(tmp_path: Path) -> None:
    """A repeated session id aborts write_traces without leaving a file or a temp file."""
    rec = _records()[0]
    path = tmp_path / "t.jsonl.gz"
    with pytest.raises(TraceFormatError, match="written twice"):
        write_traces(path, [rec, rec])
    assert list(tmp_path.iterdir()) == []


def test_write_traces_rejects_meta_that_is_not_json(tmp_path: Path) -> None:
    """meta holding a non-JSON value raises TraceFormatError naming the session."""
    rec = TraceRecord("w", "s", "st", (Message("assistant", "a"),), {"x": object()})
    with pytest.raises(TraceFormatError, match="session 's': meta is not JSON"):
        write_traces(tmp_path / "t.jsonl", [rec])


@pytest.mark.parametrize("name", ["live.jsonl", "live.jsonl.gz"])
def test_writer_appends_and_each_record_is_readable_at_once(tmp_path: Path, name: str) -> None:
    """Every write is flushed: a reader sees it while the writer is open; reopening appends."""
    path = tmp_path / name
    recs = _records()
    with TraceWriter(path) as w:
        w.write(recs[0])
        assert list(read_traces(path)) == recs[:1]
    with TraceWriter(path, fsync=True) as w:
        w.write(recs[1])
        assert w.records_written == 1
    assert list(read_traces(path)) == recs
    if name.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"


def test_writer_is_thread_safe(tmp_path: Path) -> None:
    """Records written from 8 threads at once all come back whole."""
    path = tmp_path / "live.jsonl.gz"
    text = "x" * 5000

    def work(t: int, w: TraceWriter) -> None:
        for i in range(40):
            msgs = (Message("user", f"{t}-{i}"), Message("assistant", text))
            w.write(TraceRecord("w", f"t{t}-{i}", "st", msgs))

    with TraceWriter(path) as w:
        threads = [threading.Thread(target=work, args=(t, w)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert w.records_written == 320
    back = list(read_traces(path))
    assert sorted(r.session for r in back) == sorted(
        f"t{t}-{i}" for t in range(8) for i in range(40)
    )
    assert all(r.messages[1].content == text for r in back)


def test_writer_rejects_repeated_session_and_use_after_close(tmp_path: Path) -> None:
    """A session written twice raises TraceFormatError; writing after close raises ValueError."""
    rec = _records()[0]
    w = TraceWriter(tmp_path / "t.jsonl")
    w.write(rec)
    with pytest.raises(TraceFormatError, match="already written"):
        w.write(rec)
    w.close()
    w.close()
    assert w.closed
    with pytest.raises(ValueError, match="closed"):
        w.write(_records()[1])
    assert [r.session for r in read_traces(tmp_path / "t.jsonl")] == [rec.session]
