"""docs/config-reference.md is generated from the config dataclasses
(tools/gen_config_reference.py) and the committed file is up to date: every
section and field of JobConfig, with its type, default, allowed values and
the ``#:`` comment above it."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from pathlib import Path

import pytest

from megascale_omni.config import JobConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("tool_gen_config_reference", REPO / "tools/gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_is_current(gen):
    committed = (REPO / gen.OUT).read_text()
    stale = gen.stale_sections(committed, gen.render())
    assert not stale, (
        f"{gen.OUT} is stale (sections: {', '.join(stale)}); regenerate it with: {gen.REGENERATE}"
    )


def test_every_section_and_field_is_documented(gen):
    text = gen.render()
    for section in dataclasses.fields(JobConfig):
        cls = typing.get_type_hints(JobConfig)[section.name]
        assert f"\n## `{section.name}`\n" in text
        for f in dataclasses.fields(cls):
            assert f"| `{section.name}.{f.name}` |" in text, f"{section.name}.{f.name}"
    assert "| `data.blend[].weight` | float | `1.0` |" in text


def test_rows_carry_type_default_choices_range_and_comment(gen):
    rows = {line.split(" | ")[0].strip("| `"): line for line in gen.render().splitlines() if line.startswith("| `")}
    # Literal choices, the `#:` comment (two lines joined, ``code`` as `code`).
    assert rows["parallel.cp_comm_type"].startswith(
        '| `parallel.cp_comm_type` | str | `"p2p"` | `p2p`, `a2a`, `allgather`, `a2a+p2p` | ')
    assert "`a2a+p2p` (needs `hierarchical_cp_sizes`)); the local layer spec always runs the p2p ring. |" in (
        rows["parallel.cp_comm_type"])
    # Optional with a declared range; a Literal-or-list union.
    assert "| int \\| null | `null` | > 0; or `null` |" in rows["parallel.ddp_bucket_size"]
    assert "| str \\| list[int] | `\"uniform\"` | `uniform`, `auto`; or a list[int] |" in (
        rows["parallel.pipeline_partition"])
    # A range with a note, a default built by a factory.
    assert "| int | `0` | in [0, 65535] (0 turns the exporter off) |" in rows["logging.prometheus_port"]
    assert "`[[16, 16], [16, 32]]`" in rows["dit.eval_resolutions"]


def test_comments_are_read_from_source_only_above_the_field(gen):
    @dataclasses.dataclass
    class Section:
        #: first line
        #: second line
        a: int = 1
        # a plain comment is not a description
        b: str = "x"
        c: bool = False  #: a trailing comment is not one either

    assert gen.field_comments(Section) == {"a": "first line second line", "b": "", "c": ""}


def test_check_names_stale_sections_and_the_command(gen, tmp_path, capsys):
    out = tmp_path / "ref.md"
    assert gen.main(["--check", "--out", str(out)]) == 1
    assert capsys.readouterr().out == f"{out.as_posix()} is missing; regenerate it with: {gen.REGENERATE}\n"
    assert gen.main(["--out", str(out)]) == 0
    assert gen.main(["--check", "--out", str(out)]) == 0
    text = out.read_text()
    out.write_text(text.replace("| `train.seed` | int | `1234`", "| `train.seed` | int | `1`")
                   .replace("Where the job runs.", "Where it runs."))
    assert gen.main(["--check", "--out", str(out)]) == 1
    line = capsys.readouterr().out
    assert line == f"{out.as_posix()} is stale (sections: train, platform); regenerate it with: {gen.REGENERATE}\n"
