"""Commit markers, verification, pruning, tiers (filesystem only, no torch)."""

from __future__ import annotations

import json

import pytest

from megascale_omni.checkpoint import layout


def _fake_ckpt(root, step, commit=True, payload=b"x" * 100):
    d = root / layout.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload)
    (d / "common.pt").write_bytes(b"common")
    if commit:
        layout.write_commit(d, step, {"reason": "test"})
    return d


def test_commit_marks_complete_and_lists_sizes_and_hashes(tmp_path):
    d = _fake_ckpt(tmp_path, 5)
    [info] = layout.scan_tier(tmp_path, "t")
    assert info.complete and info.step == 5
    assert info.commit["files"]["__0_0.distcp"]["size"] == 100
    assert len(info.commit["files"]["common.pt"]["sha256"]) == 64
    assert info.size_bytes == 106
    assert layout.verify(info) == []
    # The marker itself is not part of the payload.
    assert layout.COMMIT_FILE not in info.commit["files"]
    assert not list(d.glob(".*tmp"))


def test_incomplete_and_garbled_markers_are_invisible(tmp_path):
    _fake_ckpt(tmp_path, 1)
    _fake_ckpt(tmp_path, 2, commit=False)
    d3 = _fake_ckpt(tmp_path, 3, commit=False)
    (d3 / layout.COMMIT_FILE).write_text("{not json")
    (tmp_path / "not_a_step").mkdir()
    infos = layout.scan_tier(tmp_path, "t")
    assert [(c.step, c.complete) for c in infos] == [(1, True), (2, False), (3, False)]
    assert [c.step for c in layout.newest_complete([("t", tmp_path)])] == [1]
    assert layout.verify(infos[1]) == [f"no {layout.COMMIT_FILE} (the save never finished)"]


def test_verify_reports_truncation_checksum_and_missing_files(tmp_path):
    d = _fake_ckpt(tmp_path, 7)
    [info] = layout.scan_tier(tmp_path, "t")
    (d / "__0_0.distcp").write_bytes(b"x" * 60)
    assert "truncated" in layout.verify(info)[0]
    (d / "__0_0.distcp").write_bytes(b"y" * 100)  # same size, other bytes
    assert layout.verify(info) == ["__0_0.distcp: sha256 mismatch"]
    assert layout.verify(info, checksums=False) == []
    (d / "common.pt").unlink()
    assert "missing file common.pt" in layout.verify(info, checksums=False)


def test_newest_complete_prefers_newer_step_then_first_tier(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    _fake_ckpt(fast, 10)
    _fake_ckpt(slow, 10)
    _fake_ckpt(slow, 20)
    _fake_ckpt(fast, 30, commit=False)
    order = [(c.tier, c.step) for c in layout.newest_complete([("fast", fast), ("slow", slow)])]
    assert order == [("slow", 20), ("fast", 10), ("slow", 10)]
    assert layout.newest_complete([("missing", tmp_path / "nope")]) == []


def test_prune_keeps_last_k_and_never_the_newest_complete(tmp_path):
    for s in (1, 2, 3, 4):
        _fake_ckpt(tmp_path, s)
    _fake_ckpt(tmp_path, 0, commit=False)  # abandoned, older than newest: removed
    _fake_ckpt(tmp_path, 9, commit=False)  # possibly in flight: kept
    removed = layout.prune(tmp_path, "t", keep_last=2)
    assert sorted(removed) == [0, 1, 2]
    assert [(c.step, c.complete) for c in layout.scan_tier(tmp_path, "t")] == [(3, True), (4, True), (9, False)]
    assert layout.prune(tmp_path, "t", keep_last=2, keep_steps=[3]) == []
    # keep_last is at least one: the newest complete checkpoint always survives.
    layout.prune(tmp_path, "t", keep_last=0)
    assert [c.step for c in layout.scan_tier(tmp_path, "t") if c.complete] == [4]


def test_prune_without_complete_checkpoints_removes_nothing(tmp_path):
    _fake_ckpt(tmp_path, 1, commit=False)
    assert layout.prune(tmp_path, "t", keep_last=1) == []
    assert layout.remove_incomplete(tmp_path, "t") == [1]
    assert layout.scan_tier(tmp_path, "t") == []


def test_replicate_copies_files_then_marker(tmp_path):
    src_root, dst_root = tmp_path / "fast", tmp_path / "slow"
    _fake_ckpt(src_root, 4)
    [src] = layout.scan_tier(src_root, "fast")
    # A stale, incomplete copy at the destination is replaced.
    stale = dst_root / layout.step_dir_name(4)
    stale.mkdir(parents=True)
    (stale / "junk").write_text("old")
    copy = layout.replicate(src, dst_root, "slow")
    assert copy.complete and layout.verify(copy) == []
    assert not (stale / "junk").exists()
    assert json.loads((copy.path / layout.COMMIT_FILE).read_text())["replicated_from"] == str(src.path)


def test_remove_unpublishes_before_deleting(tmp_path, monkeypatch):
    d = _fake_ckpt(tmp_path, 2)
    [info] = layout.scan_tier(tmp_path, "t")
    seen = []

    def fake_rmtree(path, ignore_errors=False):
        # By the time files are deleted, the marker is already gone.
        seen.append((path / layout.COMMIT_FILE).exists())

    monkeypatch.setattr(layout.shutil, "rmtree", fake_rmtree)
    layout.remove(info)
    assert seen == [False]
    assert not layout.scan_tier(tmp_path, "t")[0].complete
    assert d.exists()


@pytest.mark.parametrize("name", ["step_1", "step_000000001", "step_abcdefgh"])
def test_only_canonical_step_names_are_checkpoints(tmp_path, name):
    (tmp_path / name).mkdir()
    assert layout.scan_tier(tmp_path, "t") == []


def test_ckpt_tool_lists_and_verifies(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckpt_tool", "tools/ckpt.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _fake_ckpt(tmp_path, 3)
    d7 = _fake_ckpt(tmp_path, 7)
    _fake_ckpt(tmp_path, 9, commit=False)
    assert tool.main(["list", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"]) for r in rows] == [(9, "incomplete"), (7, "complete"), (3, "complete")]
    assert tool.main(["verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count(": OK") == 2
    (d7 / "__0_0.distcp").write_bytes(b"z" * 100)
    assert tool.main(["verify", str(d7)]) == 1
    assert "BROKEN: __0_0.distcp: sha256 mismatch" in capsys.readouterr().out
    assert tool.main(["verify", str(d7), "--no-checksums"]) == 0
    with pytest.raises(SystemExit) as exc:
        tool.main(["verify", str(tmp_path / "missing")])
    assert exc.value.code == 2


def test_ckpt_tool_cleans_only_old_unfinished_saves(tmp_path, capsys):
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("ckpt_tool", "tools/ckpt.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _fake_ckpt(tmp_path, 2, commit=False)
    # Nothing complete yet: every save may still be running.
    assert tool.main(["clean", str(tmp_path), "--min-age-minutes", "0", "--yes"]) == 2
    assert (tmp_path / layout.step_dir_name(2)).exists()
    assert tool.main(["clean", str(tmp_path), "--min-age-minutes", "-1", "--yes"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
    old = _fake_ckpt(tmp_path, 4, commit=False)
    _fake_ckpt(tmp_path, 6)
    fresh = _fake_ckpt(tmp_path, 5, commit=False)  # older step, but touched just now
    newer = _fake_ckpt(tmp_path, 8, commit=False)  # newer than the newest complete: maybe in flight
    hour_ago = os.path.getmtime(old) - 3600
    for d in (tmp_path / layout.step_dir_name(2), old, newer):
        for p in [d, *d.rglob("*")]:
            os.utime(p, (hour_ago, hour_ago))
    assert tool.main(["clean", str(tmp_path)]) == 0
    assert "would remove" in capsys.readouterr().out and old.exists()
    assert tool.main(["clean", str(tmp_path), "--yes"]) == 0
    assert [c.step for c in layout.scan_tier(tmp_path, "t")] == [5, 6, 8]
    assert fresh.exists() and newer.exists()


def test_resolve_takes_a_step_dir_or_the_newest_intact_under_a_root(tmp_path, caplog):
    _fake_ckpt(tmp_path, 5)
    d10 = _fake_ckpt(tmp_path, 10)
    _fake_ckpt(tmp_path, 15, commit=False)
    assert layout.resolve(tmp_path).step == 10
    assert layout.resolve(d10).path == d10
    (d10 / "__0_0.distcp").write_bytes(b"x" * 60)
    assert layout.resolve(tmp_path).step == 5  # the broken newest is skipped, with a warning
    assert "falling back to the previous complete checkpoint" in caplog.text
    with pytest.raises(layout.CheckpointError, match="is broken: __0_0.distcp: size 60 bytes"):
        layout.resolve(d10)
    with pytest.raises(layout.CheckpointError, match=f"no {layout.COMMIT_FILE}"):
        layout.resolve(tmp_path / layout.step_dir_name(15))
    _fake_ckpt(tmp_path / "unfinished", 3, commit=False)
    with pytest.raises(layout.CheckpointError, match=r"steps \[3\] never finished saving"):
        layout.resolve(tmp_path / "unfinished")
    (tmp_path / "empty").mkdir()
    with pytest.raises(layout.CheckpointError, match="expected step_NNNNNNNN directories"):
        layout.resolve(tmp_path / "empty")
