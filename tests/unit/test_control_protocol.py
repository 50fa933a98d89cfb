"""Control protocol, command validation and boundary encoding (no sockets)."""

from __future__ import annotations

import json
import os
import math

import pytest

from megascale_omni.config import ConfigError, JobConfig, control_socket_path, from_dict, validate_job
from megascale_omni.config.validate import MAX_UNIX_SOCKET_PATH
from megascale_omni.control.cli import build_parser, format_result, request_of
from megascale_omni.control.client import parse_target
from megascale_omni.control.commands import MUTABLE_FIELD_NAMES, Op, check_args, check_config_set, set_field
from megascale_omni.control.exchange import MAX_OPS, SIZE, decode_ops, encode_ops
from megascale_omni.control.protocol import (
    MAX_MESSAGE_BYTES,
    ErrorCode,
    ProtocolError,
    Request,
    encode,
    parse_request,
)


def _line(obj) -> bytes:
    return json.dumps(obj).encode()


def _code(line: bytes) -> str:
    with pytest.raises(ProtocolError) as e:
        parse_request(line)
    return e.value.code


def test_parse_valid_request():
    r = parse_request(_line({"version": 1, "id": 7, "cmd": "metrics", "args": {"last": 3}, "token": "t"}))
    assert r == Request(cmd="metrics", args={"last": 3}, id=7, token="t")
    assert parse_request(_line({"version": 1, "cmd": "status"})) == Request(cmd="status")


@pytest.mark.parametrize(
    "line, code",
    [
        (b"{not json", ErrorCode.PARSE_ERROR),
        (b"\xff\xfe{}", ErrorCode.PARSE_ERROR),
        (b'{"version": 1, "cmd": "status", "args": {"x": NaN}}', ErrorCode.PARSE_ERROR),
        (_line([1, 2]), ErrorCode.BAD_REQUEST),
        (_line("status"), ErrorCode.BAD_REQUEST),
        (_line({"version": 1, "cmd": "status", "extra": 1}), ErrorCode.BAD_REQUEST),
        (_line({"version": 1, "cmd": ""}), ErrorCode.BAD_REQUEST),
        (_line({"version": 1, "cmd": 5}), ErrorCode.BAD_REQUEST),
        (_line({"version": 1, "cmd": "status", "args": [1]}), ErrorCode.BAD_REQUEST),
        (_line({"version": 1, "cmd": "status", "token": 123}), ErrorCode.BAD_REQUEST),
        (_line({"version": 1, "cmd": "status", "id": [1]}), ErrorCode.BAD_REQUEST),
        (_line({"version": 1, "cmd": "status", "id": "x" * 129}), ErrorCode.BAD_REQUEST),
        (_line({"cmd": "status"}), ErrorCode.UNSUPPORTED_VERSION),
        (_line({"version": 2, "cmd": "status"}), ErrorCode.UNSUPPORTED_VERSION),
        (_line({"version": True, "cmd": "status"}), ErrorCode.UNSUPPORTED_VERSION),
        (_line({"version": 1.0, "cmd": "status"}), ErrorCode.UNSUPPORTED_VERSION),
    ],
)
def test_malformed_requests_get_a_code(line, code):
    assert _code(line) == code


def test_nesting_bomb_inside_the_limit_is_a_parse_error():
    line = b"[" * 30000 + b"]" * 30000
    assert len(line) <= MAX_MESSAGE_BYTES
    assert _code(line) == ErrorCode.PARSE_ERROR


def test_oversized_line_is_refused_before_parsing():
    assert _code(b" " * (MAX_MESSAGE_BYTES + 1)) == ErrorCode.MESSAGE_TOO_LARGE


def test_replies_are_strict_json_even_for_nan():
    line = encode({"loss": float("nan"), "x": [float("inf"), -math.inf], "ok": 1.5})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"loss": "NaN", "x": ["Infinity", "-Infinity"], "ok": 1.5}


def _req(cmd, **args):
    return Request(cmd=cmd, args=args, id="r")


@pytest.mark.parametrize(
    "request_, code, field",
    [
        (_req("reboot"), ErrorCode.UNKNOWN_COMMAND, None),
        (_req("status", verbose=True), ErrorCode.INVALID_ARGS, "verbose"),
        (_req("metrics", last="5"), ErrorCode.INVALID_ARGS, "last"),
        (_req("metrics", last=True), ErrorCode.INVALID_ARGS, "last"),
        (_req("metrics", last=2.0), ErrorCode.INVALID_ARGS, "last"),
        (_req("metrics", last=0), ErrorCode.INVALID_ARGS, "last"),
        (_req("metrics", last=101), ErrorCode.INVALID_ARGS, "last"),
        (_req("config"), ErrorCode.INVALID_ARGS, "action"),
        (_req("config", action="delete"), ErrorCode.INVALID_ARGS, "action"),
        (_req("config", action="set", field="train.steps", value=[1]), ErrorCode.INVALID_ARGS, "value"),
        (_req("config", action="get", field=3), ErrorCode.INVALID_ARGS, "field"),
    ],
)
def test_bad_arguments_name_the_argument(request_, code, field):
    with pytest.raises(ProtocolError) as e:
        check_args(request_)
    assert e.value.code == code
    assert e.value.request_id == "r"
    if field is not None:
        assert e.value.details["field"] == field and "hint" in e.value.details


@pytest.mark.parametrize(
    "field, value, hint",
    [
        ("train.eval_interval", "5", "must be an integer"),
        ("train.eval_interval", 2.5, "must be an integer"),
        ("train.eval_interval", True, "must be an integer"),
        ("train.eval_interval", -1, ">= 0"),
        ("logging.log_interval", 0, "> 0"),
        ("data.max_bad_sample_fraction", 1.5, "[0, 1]"),
        ("train.steps", 2**60, "2**53"),
        ("model.hidden_size", 32, "restart"),
        ("logging.output_dir", "/tmp/x", "restart"),
    ],
)
def test_config_set_rejects_with_field_value_fix(field, value, hint):
    cfg = JobConfig()
    before = json.dumps(JobConfig().__dict__, default=str)
    with pytest.raises(ProtocolError) as e:
        check_config_set(_req("config"), cfg, {"action": "set", "field": field, "value": value})
    assert e.value.code == ErrorCode.INVALID_VALUE
    assert e.value.details["field"] == field
    assert hint in e.value.message + e.value.details.get("hint", "")
    assert json.dumps(cfg.__dict__, default=str) == before  # nothing changed


def test_config_set_coerces_like_the_yaml_loader():
    cfg = JobConfig()
    op = check_config_set(_req("config"), cfg, {"action": "set", "field": "data.max_bad_sample_fraction", "value": 0})
    assert op == Op("config_set", "data.max_bad_sample_fraction", 0.0)
    assert isinstance(op.value, float)
    # Received as float64 on every rank, stored with the declared type.
    assert set_field(cfg, "train.eval_interval", 7.0) == 7 and type(cfg.train.eval_interval) is int


def test_boundary_vector_round_trip_is_exact():
    ops = [Op("pause"), Op("config_set", "train.steps", 2**53 - 1), Op("config_set", "data.max_bad_sample_fraction",
           0.1 + 0.2), Op("drain"), Op("resume"), Op("checkpoint")]
    values = [0.0] * SIZE
    encode_ops(values, ops)
    assert decode_ops(values) == [
        Op("pause"), Op("config_set", "train.steps", float(2**53 - 1)),
        Op("config_set", "data.max_bad_sample_fraction", 0.1 + 0.2), Op("drain"), Op("resume"), Op("checkpoint"),
    ]
    # The command vector carries commands only (records travel on metrics.exchange).
    assert SIZE == 1 + 3 * MAX_OPS
    assert decode_ops([0.0] * SIZE) == []
    with pytest.raises(AssertionError):
        encode_ops([0.0] * SIZE, [Op("pause")] * (MAX_OPS + 1))
    assert len(MUTABLE_FIELD_NAMES) == 4


def test_parse_target():
    assert parse_target("runs/x/control.sock") == "runs/x/control.sock"
    assert parse_target("unix:ctl") == "ctl"
    assert parse_target("127.0.0.1:7700") == ("127.0.0.1", 7700)
    assert parse_target("tcp:[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError):
        parse_target("nowhere")


def test_cli_builds_requests_and_formats_results():
    p = build_parser()
    assert request_of(p.parse_args(["-s", "x.sock", "config", "set", "train.eval_interval", "5"])) == (
        "config", {"action": "set", "field": "train.eval_interval", "value": 5})
    assert request_of(p.parse_args(["-s", "x.sock", "metrics", "--last", "3"])) == ("metrics", {"last": 3})
    assert request_of(p.parse_args(["-s", "x.sock", "drain"])) == ("drain", {})
    text = format_result("metrics", {}, {"records": [{"step": 3, "loss": 1.5, "lr": 1e-3}]})
    assert text.splitlines()[1].split()[:3] == ["3", "1.5", "0.001"]
    assert format_result("pause", {}, {"state": "paused", "step": 4, "changed": True}) == "paused at step 4"


def test_control_config_validation(tmp_path, monkeypatch):
    def cfg(**control):
        return from_dict(JobConfig, {"logging": {"output_dir": str(tmp_path)}, "control": control})

    monkeypatch.delenv("MEGASCALE_CONTROL_TOKEN", raising=False)
    validate_job(cfg(), 1)
    assert control_socket_path(cfg()) == str(tmp_path / "control.sock")
    with pytest.raises(ConfigError) as e:
        validate_job(cfg(socket_path="/tmp/" + "x" * 120), 1)
    assert e.value.field == "control.socket_path" and f"{MAX_UNIX_SOCKET_PATH} bytes" in e.value.hint
    # The longest accepted path still binds: the server's temporary name fits sun_path.
    longest = tmp_path / ("s" * (MAX_UNIX_SOCKET_PATH - len(os.fsencode(str(tmp_path))) - 1))
    assert len(os.fsencode(str(longest))) == MAX_UNIX_SOCKET_PATH
    validate_job(cfg(socket_path=str(longest)), 1)
    with pytest.raises(ConfigError):
        validate_job(cfg(socket_path=str(longest) + "s"), 1)
    # A run directory too deep for the default socket gets a short one instead of an error.
    deep = tmp_path / ("d" * 100)
    long_default = from_dict(JobConfig, {"logging": {"output_dir": str(deep)}})
    validate_job(long_default, 1)
    short = control_socket_path(long_default)
    assert len(short) <= MAX_UNIX_SOCKET_PATH and short.endswith(".sock") and short == control_socket_path(long_default)
    with pytest.raises(ConfigError) as e:
        validate_job(cfg(tcp_port=0), 1)
    assert e.value.field == "control.tcp_port" and "token" in e.value.hint
    monkeypatch.setenv("MEGASCALE_CONTROL_TOKEN", "short")
    with pytest.raises(ConfigError) as e:
        validate_job(cfg(tcp_port=0), 1)
    assert "shorter than 16" in e.value.hint and "short" not in str(e.value.value)
    monkeypatch.setenv("MEGASCALE_CONTROL_TOKEN", "a" * 32)
    validate_job(cfg(tcp_port=0), 1)
    with pytest.raises(ConfigError) as e:
        validate_job(cfg(tcp_port=0, token_file=str(tmp_path / "missing")), 1)
    assert e.value.field == "control.token_file"
    with pytest.raises(ConfigError) as e:
        cfg(tcp_port=70000)
    assert e.value.field == "control.tcp_port"
    validate_job(cfg(enabled=False, socket_path="/tmp/" + "x" * 120), 1)
