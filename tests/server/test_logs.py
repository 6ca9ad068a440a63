"""The daemon's log: every line valid logfmt (``kv``) or a JSON object (``json``), its fields
as keys, and no value able to end a line or forge a pair.

The parsers are written here, strictly (a stray space, an unescaped quote or a control
character fails), and run over every line a real daemon writes during a workload that puts a
hostile worker name in its records.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cli_support import Served, clean_env, write_config
from daemon_proc import LAYOUT, TENANTS, TOKENS, admit, md

from blockd import logs
from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc

# -- a strict logfmt parser -------------------------------------------------------------------

_KEY = r"[A-Za-z_][A-Za-z0-9_.\-]*"
_QUOTED = r'"(?:[^"\\\x00-\x1f\x7f-\x9f\u2028\u2029]|\\["\\nrt]|\\u[0-9a-f]{4})*"'
_BARE = r'[^\s"=\\\x00-\x1f\x7f-\x9f\u2028\u2029]*'
_PAIR = re.compile(rf"({_KEY})=({_QUOTED}|{_BARE})")
_ESCAPE = re.compile(r'\\(["\\nrt]|u[0-9a-f]{4})')
_UNESCAPE = {'"': '"', "\\": "\\", "n": "\n", "r": "\r", "t": "\t"}
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
LEVELS = {"debug", "info", "warning", "error", "critical"}


def parse_logfmt(line: str) -> dict[str, str]:
    """One logfmt line as a dict; AssertionError unless it is exactly ``k=v`` pairs separated
    by single spaces, unique keys, values bare or quoted with the escapes blockd writes."""
    out: dict[str, str] = {}
    pos = 0
    while True:
        m = _PAIR.match(line, pos)
        assert m, f"not logfmt at column {pos}: {line!r}"
        key, raw = m.groups()
        assert key not in out, f"duplicate key {key}: {line!r}"
        if raw.startswith('"'):
            out[key] = _ESCAPE.sub(lambda e: _UNESCAPE.get(e.group(1))
                                   or chr(int(e.group(1)[1:], 16)), raw[1:-1])
        else:
            out[key] = raw
        pos = m.end()
        if pos == len(line):
            return out
        assert line[pos] == " " and pos + 1 < len(line) and line[pos + 1] != " ", repr(line)
        pos += 1


def check_record(rec: dict[str, Any]) -> None:
    assert list(rec)[:4] == ["ts", "level", "logger", "msg"], rec
    assert TS.fullmatch(rec["ts"]) and rec["level"] in LEVELS and rec["msg"], rec


def kv_records(text: str) -> list[dict[str, str]]:
    """Every line of ``text`` parsed (split at every character Python takes for a line end)."""
    assert text.endswith("\n")
    records = [parse_logfmt(line) for line in text.splitlines()]
    for rec in records:
        check_record(rec)
    return records


def json_records(text: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in text.splitlines()]
    for rec in records:
        assert isinstance(rec, dict)
        check_record(rec)
    return records


def test_the_parser_is_strict() -> None:
    assert parse_logfmt('a=1 b="x y" c=') == {"a": "1", "b": "x y", "c": ""}
    assert parse_logfmt(r'a="q\"\\\n\u2028"') == {"a": 'q"\\\n\u2028'}
    for bad in ["a=1  b=2", "a=1 ", "a=x y", 'a="x', 'a="x"y', "=1", "a=1 a=2", 'a=x"y',
                'a="\x01"', "a=b=c", "a=\x85"]:
        with pytest.raises(AssertionError):
            parse_logfmt(bad)


# -- the formatters ---------------------------------------------------------------------------

HOSTILE = ["w\nlevel=error msg=forged", 'a "quoted" name', "back\\slash", "eq=sign", "",
           "tab\there", "cr\rlf", "nel\x85", "ls\u2028ps\u2029", "bell\x07", "del\x7f", "é ü",
           "trailing ", "\\", '"', "x" * 300]


def _record(message: str = "session attached", **kw: Any) -> logging.LogRecord:
    rec = logging.LogRecord("blockd.sessions", logging.INFO, __file__, 1, message, None, None)
    rec.__dict__.update(logs.fields(**kw))
    return rec


@pytest.mark.parametrize("value", HOSTILE)
def test_no_value_breaks_a_kv_line_or_forges_a_pair(value: str) -> None:
    line = logs.KvFormatter().format(_record(worker=value, tenant="acme", n=3))
    assert len(line.splitlines()) == 1 and "\n" not in line
    rec = parse_logfmt(line)
    assert rec["worker"] == value and rec["tenant"] == "acme" and rec["n"] == "3"
    assert rec["level"] == "info" and rec["msg"] == "session attached"
    assert list(rec) == ["ts", "level", "logger", "msg", "worker", "tenant", "n"]


@pytest.mark.parametrize("value", HOSTILE)
def test_no_value_breaks_a_json_line(value: str) -> None:
    line = logs.JsonFormatter().format(_record(worker=value, n=3, ok=True, f=0.5))
    assert len(line.splitlines()) == 1 and line.isascii()
    rec = json.loads(line)
    assert rec["worker"] == value and rec["n"] == 3 and rec["ok"] is True and rec["f"] == 0.5


def test_values_and_keys_are_written_as_what_they_are() -> None:
    kv = logs.KvFormatter()
    rec = parse_logfmt(kv.format(_record(a=True, b=None, c=1.5, d=Path("/x y"), msg="m",
                                         **{"pool.num_blocks": 16})))
    assert rec["a"] == "true" and "b" not in rec and rec["c"] == "1.5" and rec["d"] == "/x y"
    assert rec["msg"] == "session attached" and rec["msg_"] == "m"  # a field cannot replace it
    assert rec["pool.num_blocks"] == "16"
    doc = json.loads(logs.JsonFormatter().format(_record(nan=float("nan"), p=Path("/p"))))
    assert doc["nan"] == "nan" and doc["p"] == "/p"
    msg = parse_logfmt(kv.format(_record("a message\nwith=a line break")))
    assert msg["msg"] == "a message\nwith=a line break"


def test_an_exception_is_one_escaped_field() -> None:
    try:
        raise ValueError('bad "thing"\nsecond line')
    except ValueError:
        rec = _record(task="x")
        rec.exc_info = sys.exc_info()
    line = logs.KvFormatter().format(rec)
    assert len(line.splitlines()) == 1
    parsed = parse_logfmt(line)
    assert list(parsed)[-1] == "exc" and parsed["exc"].startswith("Traceback (most recent")
    assert parsed["exc"].endswith('ValueError: bad "thing"\nsecond line')
    doc = json.loads(logs.JsonFormatter().format(rec))
    assert list(doc)[-1] == "exc" and doc["exc"] == parsed["exc"]


def test_ts_is_rfc3339_utc_with_milliseconds() -> None:
    assert logs.rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert logs.rfc3339(1_700_000_000.25) == "2023-11-14T22:13:20.250Z"


# -- a real daemon's every line ---------------------------------------------------------------

#: The worker name the workload attaches with: a line break, a forged pair, quotes.
FORGER = 'w1\nts=2000-01-01T00:00:00.000Z level=error logger=blockd msg="forged" x=\u2028y'


def _workload(workdir: Path, fmt: str) -> tuple[str, list[str]]:
    """A daemon through attach (with FORGER's name), steps, a refused credential, a lease
    expiry, a tenants reload and a stop; its stderr and stdout."""
    tenants = workdir / "tenants.yaml"
    tenants.write_text(yaml.safe_dump(TENANTS))
    cfg = write_config(workdir, pool={"num_layers": 2, "num_kv_heads": 2},
                       tenants={"file": str(tenants), "allow_anonymous": False},
                       lease={"min_ms": 100}, log={"format": fmt})
    env = clean_env(BLOCKD_POOL_NUM_BLOCK="16", BLOCKD_FROBNICATE="1",
                    BLOCKD_TOKEN=TOKENS["admin"])
    with Served("--config", str(cfg), cwd=workdir, env=env) as d, \
            grpc.insecure_channel(f"unix:{d.endpoints['unix']}") as ch:
        stub = pb_grpc.BlockdServiceStub(ch)
        att = stub.Attach(pb.AttachRequest(worker_name=FORGER, tenant_id="acme", layout=LAYOUT),
                          metadata=md("alice"))
        step = pb.StepRequest(session_id=att.session_id, epoch=att.epoch, step_id=1,
                              operations=[admit(list(range(10)))])
        assert stub.Step(step, metadata=md("alice")).results[0].status.code == 0
        with pytest.raises(grpc.RpcError):
            stub.Stats(pb.StatsRequest(), metadata=(("authorization", "Bearer tok-wrong"),))
        stub.Detach(pb.DetachRequest(session_id=att.session_id), metadata=md("alice"))
        stub.Attach(pb.AttachRequest(worker_name="quiet", tenant_id="globex", layout=LAYOUT,
                                     lease_ms=100), metadata=md("bob"))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not ("lease expired" in d.stderr() and "tenants reloaded" in d.stderr()):
            assert time.monotonic() < deadline, d.stderr()
            time.sleep(0.05)
        assert d.stop() == 0
        return d.stderr(), d.stdout


def _by_msg(records: list[dict[str, Any]], msg: str) -> list[dict[str, Any]]:
    return [r for r in records if r["msg"] == msg]


def _check_workload(records: list[dict[str, Any]], text: str) -> None:
    msgs = [r["msg"] for r in records]
    assert msgs[:2] == ["unknown environment variable ignored"] * 2, msgs
    assert msgs[2:4] == ["configuration", "serving"] and msgs[-2:] == ["draining", "stopped"]
    warned = {r["variable"]: r.get("did_you_mean") for r in records[:2]}
    assert warned == {"BLOCKD_FROBNICATE": None, "BLOCKD_POOL_NUM_BLOCK": "BLOCKD_POOL_NUM_BLOCKS"}
    attached = _by_msg(records, "session attached")
    assert [r["worker"] for r in attached] == [FORGER, "quiet"]
    assert attached[0]["tenant"] == "acme"
    closed = _by_msg(records, "session closed")
    assert [(r["worker"], r["reason"]) for r in closed] == [(FORGER, "detach"),
                                                            ("quiet", "lease expired")]
    assert _by_msg(records, "tenants reloaded")
    assert not [r for r in records if r["level"] in ("error", "critical")], records
    assert not [r for r in records if r["msg"] == "forged"]
    for secret in [*TOKENS.values(), "tok-wrong"]:  # credentials are never logged
        assert secret not in text


def test_every_line_of_a_real_run_is_logfmt(tmp_path: Path) -> None:
    text, stdout = _workload(tmp_path, "kv")
    records = kv_records(text)
    _check_workload(records, text)
    config = _by_msg(records, "configuration")[0]
    assert config["pool.num_blocks"] == "16" and config["log.format"] == "kv"
    serving = _by_msg(records, "serving")[0]
    assert serving["unix"] == str(tmp_path / "blockd.sock") and serving["pid"].isdigit()
    assert _by_msg(records, "session attached")[0]["lease_ms"] == "10000"
    assert len(stdout) == 1 and stdout[0].startswith("BLOCKD_READY {")


def test_every_line_of_a_real_run_is_json(tmp_path: Path) -> None:
    text, _ = _workload(tmp_path, "json")
    records = json_records(text)
    _check_workload(records, text)
    config = _by_msg(records, "configuration")[0]
    assert config["pool.num_blocks"] == 16 and config["server.check_invariants"] is False
    assert _by_msg(records, "session attached")[0]["lease_ms"] == 10000
    assert isinstance(_by_msg(records, "serving")[0]["epoch"], int)
