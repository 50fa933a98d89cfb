"""Bad invocations of the tools and bad files they read: a usage or path
problem exits 2 with one line, a broken checkpoint is reported as broken
(exit 1 from `ckpt.py verify`), never a traceback and never a false OK."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megascale_omni.checkpoint import layout
from megascale_omni.control import cli as omni_ctl
from megascale_omni.entry import run_cli


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", f"tools/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exit_code(fn) -> int:
    with pytest.raises(SystemExit) as e:
        run_cli(fn)
    return e.value.code


def _ckpt_dir(root: Path, step: int, commit: dict) -> Path:
    d = root / layout.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 10)
    (d / layout.COMMIT_FILE).write_text(json.dumps(commit))
    return d


GOOD_FILE = {"size": 10, "sha256": "0" * 64}


@pytest.mark.parametrize("case,commit,problem", [
    ("empty-file-list", {"files": {}}, "lists no files"),
    ("size-a-string", {"files": {"__0_0.distcp": {"size": "10", "sha256": "0" * 64}}}, "malformed entry"),
    ("entry-a-list", {"files": {"__0_0.distcp": [10]}}, "malformed entry"),
    ("no-sha", {"files": {"__0_0.distcp": {"size": 10}}}, "malformed entry"),
    ("path-escapes", {"files": {"../../etc/passwd": GOOD_FILE}}, "outside the checkpoint directory"),
])
def test_ckpt_verify_never_says_ok_for_a_bad_marker(tmp_path, capsys, case, commit, problem):
    tool = _tool("ckpt")
    _ckpt_dir(tmp_path, 5, commit)
    assert tool.main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "BROKEN" in out and problem in out and ": OK" not in out


@pytest.mark.parametrize("content,problem", [
    (b'{"files": {"__0_0.distcp": {"si', "is not valid JSON (Unterminated string at line 1 column 29; truncated or overwritten?)"),
    (b"\x00\xff garbage", "is not UTF-8 text"),
    (b"[1, 2]", "must hold a JSON object, not a list"),
    (b'{"files": ["__0_0.distcp"]}', 'has no "files" object'),
])
@pytest.mark.parametrize("target", ["step", "root"])
def test_ckpt_verify_names_an_unreadable_marker_and_exits_4(tmp_path, capsys, content, problem, target):
    tool = _tool("ckpt")
    d = _ckpt_dir(tmp_path, 5, {})
    (d / layout.COMMIT_FILE).write_bytes(content)
    assert tool.main(["verify", str(d if target == "step" else tmp_path)]) == tool.EXIT_CHECKPOINT == 4
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith(f"ckpt: {d / layout.COMMIT_FILE}: {problem}") and ": OK" not in out


def test_ckpt_list_shows_hand_edited_markers(tmp_path, capsys):
    tool = _tool("ckpt")
    _ckpt_dir(tmp_path, 5, {"files": {"__0_0.distcp": GOOD_FILE}, "layout": {"tp": 2}, "committed_unix": "noon",
                            "reason": ["x"]})
    _ckpt_dir(tmp_path, 6, {"files": {"__0_0.distcp": {"size": "big"}}, "layout": [1, 2], "committed_unix": 1e30})
    assert tool.main(["list", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[5]["layout"] == "tp2 pp? dp?" and rows[5]["committed"] == "?"
    assert rows[6]["layout"] == "" and rows[6]["committed"] == "?" and rows[6]["size_mb"] == 0.0


def test_ckpt_clean_refuses_nan_age(tmp_path, capsys):
    tool = _tool("ckpt")
    _ckpt_dir(tmp_path, 5, {"files": {"__0_0.distcp": GOOD_FILE}})
    assert tool.main(["clean", str(tmp_path), "--min-age-minutes", "nan"]) == 2
    assert "must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("args,field", [
    (["--size", "0x0"], "--size"),
    (["--size", "16x-8"], "--size"),
    (["--size", "big"], "--size"),
    (["--per-prompt", "-1"], "--per-prompt"),
    (["--steps", "0"], "--steps"),
    (["--guidance", "nan"], "--guidance"),
    (["--vae", "stabilityai/sd-vae-ft-mse"], "--vae"),  # not a local directory: never fetched from a hub
    (["--text-encoder", "/nonexistent/encoder"], "--text-encoder"),
])
def test_sample_dit_bad_arguments_exit_2_naming_the_option(tmp_path, capsys, args, field):
    tool = _tool("sample_dit")
    argv = ["--checkpoint", str(tmp_path / "none"), "--prompt", "a red circle", "--out", str(tmp_path / "g.png"),
            *args]
    assert _exit_code(lambda: tool.main(argv)) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"config error: {field}=")


@pytest.mark.parametrize("out,hint", [
    ("afile/g.png", "is a file, not a directory"),
    ("afile/deeper/g.png", "is a file, not a directory"),
    ("adir", "is a directory; give a file path such as"),
    ("g.notanimage", "needs an image file extension PIL can write"),
])
def test_sample_dit_checks_out_before_loading_anything(tmp_path, capsys, out, hint):
    tool = _tool("sample_dit")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    # The checkpoint does not exist either: --out is refused first, before any loading or sampling.
    argv = ["--checkpoint", str(tmp_path / "none"), "--prompt", "a red circle", "--out", str(tmp_path / out)]
    assert _exit_code(lambda: tool.main(argv)) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"config error: --out='{tmp_path / out}': ") and hint in line


def test_plan_pipeline_refuses_a_negative_world_size(monkeypatch, capsys):
    tool = _tool("plan_pipeline")
    monkeypatch.setattr(sys, "argv", ["plan_pipeline.py", "--world-size", "-4", "--config", "examples/gpt/tiny.yaml"])
    assert _exit_code(tool.main) == 2
    assert capsys.readouterr().err.strip() == "config error: --world-size=-4: must be >= 1 (processes of the job)"


@pytest.mark.parametrize("content,words", [
    ("{not json", "is unreadable"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"unix": null, "tcp": 7}', "names no endpoint"),
    ("\udcff", "is unreadable"),
])
def test_omni_ctl_reports_a_malformed_control_json(tmp_path, capsys, content, words):
    (tmp_path / "control.json").write_bytes(content.encode("utf-8", errors="surrogateescape"))
    assert omni_ctl.main(["--run-dir", str(tmp_path), "status"]) == omni_ctl.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("omni-ctl: ") and words in err and str(tmp_path / "control.json") in err


@pytest.mark.parametrize("timeout", ["nan", "0", "-1", "inf"])
def test_omni_ctl_refuses_a_bad_timeout(tmp_path, capsys, timeout):
    assert omni_ctl.main(["--run-dir", str(tmp_path), "--timeout", timeout, "status"]) == omni_ctl.EXIT_USAGE
    assert "--timeout" in capsys.readouterr().err
