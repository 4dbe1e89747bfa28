"""bench/compare.py: the verdict per row, the matching of rows over rounds, the knobs an older
commit's script lacks, and the detached worktrees it runs each side from."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_compare():
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "bench" / "compare.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


C = _load_compare()


def row(metric: str, p50: float | None, p99: float | None, unit: str = "ms", **kw):
    return {"metric": metric, "p50": p50, "p99": p99, "unit": unit, **kw}


@pytest.mark.parametrize(
    ("unit", "better", "higher"),
    [
        ("ms", None, False),
        ("MiB", None, False),
        ("MB/s", None, True),
        ("/s", None, True),
        ("req/s", None, True),
        ("ms", "higher", True),
        ("MB/s", "lower", False),
    ],
)
def test_direction_comes_from_the_unit_unless_the_row_says(unit, better, higher):
    r = row("m", 1, 1, unit) | ({"better": better} if better else {})
    assert C.higher_is_better(r) is higher


def test_latency_within_thresholds_is_ok_and_beyond_them_regresses():
    assert not C.judge(10.0, 10.99, 20.0, 23.9, higher=False).regressed
    slow50 = C.judge(10.0, 11.2, 20.0, 20.0, higher=False)
    assert slow50.regressed and "p50 +12% worse" in slow50.text
    slow99 = C.judge(10.0, 10.0, 20.0, 24.5, higher=False)
    assert slow99.regressed and "p99" in slow99.text and "p50" not in slow99.text
    assert slow99.ratio_p50 == pytest.approx(1.0) and slow99.ratio_p99 == pytest.approx(1.225)


def test_a_faster_latency_is_never_a_regression():
    v = C.judge(10.0, 5.0, 20.0, 8.0, higher=False)
    assert not v.regressed and v.text.startswith("ok (") and "better" in v.text


def test_a_rate_regresses_when_it_drops_not_when_it_rises():
    assert C.judge(500.0, 440.0, 400.0, 400.0, higher=True).regressed  # -12 %
    assert not C.judge(500.0, 460.0, 400.0, 330.0, higher=True).regressed  # -8 %, -17.5 %
    assert not C.judge(500.0, 900.0, 400.0, 900.0, higher=True).regressed
    assert C.judge(500.0, 500.0, 400.0, 310.0, higher=True).regressed  # worst run -22.5 %


def test_rows_without_a_p99_or_a_positive_base_are_not_judged_on_it():
    only50 = C.judge(30.0, 29.0, None, None, higher=True)  # churn has no p99
    assert not only50.regressed and only50.ratio_p99 is None
    nothing = C.judge(0.0, 5.0, None, None, higher=False)  # a difference can be 0 or less
    assert not nothing.regressed and nothing.text.startswith("n/a")


def test_rounds_are_summarised_by_their_median_and_rows_matched_by_metric():
    base = [
        {"rows": [row("exec", 5.0, 7.0), row("only old", 1, 1)]},
        {"rows": [row("exec", 6.0, 9.0)]},
        {"rows": [row("exec", 5.5, 30.0)]},
    ]
    cand = [
        {"rows": [row("exec", 5.4, 8.0), row("new", 2, 2, "MB/s")]},
        {"rows": [row("exec", 7.0, 8.0)]},
        {"rows": [row("exec", 5.6, 8.5)]},
    ]
    rows, notes = C.compare("exec_latency", base, cand)
    [exec_row] = rows
    assert (exec_row.base.p50, exec_row.cand.p50) == (5.5, 5.6)
    assert (exec_row.base.p99, exec_row.cand.p99) == (9.0, 8.0)
    assert exec_row.base.p50s == [5.0, 6.0, 5.5] and not exec_row.verdict.regressed
    assert any("only the base has the row 'only old'" in n for n in notes)
    assert any("only the candidate has the row 'new'" in n for n in notes)
    assert "| exec_latency | exec | ms (lower is better) | 5.50 | 5.60 | 1.02×" in C.table(rows)


def test_a_missing_round_is_left_out_of_the_median():
    rows, _ = C.compare(
        "churn",
        [{"rows": [row("rate", 30, None, "/s")]}, {"rows": []}],
        [{"rows": [row("rate", 20, None, "/s")]}],
    )
    assert rows[0].base.p50s == [30.0] and rows[0].verdict.regressed


HELP = """usage: exec_latency.py [-h] [--json JSON] [--profile] [-n N]

options:
  -h, --help   show this help message and exit
  --json JSON  also write the results here as JSON
  --profile    attach py-spy
  -n N         HTTP round trips (default 500)
"""


def test_options_an_older_script_lacks_are_dropped_with_their_values():
    kept, dropped = C.supported_args(
        ["-n", "100", "--floor-n", "30", "--profile", "--new-knob=3", "--flag", "-n", "-5"], HELP
    )
    assert kept == ["-n", "100", "--profile", "-n", "-5"]
    assert dropped == ["--floor-n", "30", "--new-knob=3", "--flag"]


def test_args_are_given_per_benchmark_as_name_equals_words():
    extra = C.parse_extra(
        ["exec_latency=-n 100 --floor-n 30", "churn=--seconds 3", "exec_latency=--profile"]
    )
    assert extra == {
        "exec_latency": ["-n", "100", "--floor-n", "30", "--profile"],
        "churn": ["--seconds", "3"],
    }
    with pytest.raises(SystemExit, match="NAME=ARGS"):
        C.parse_extra(["-n 100"])


def test_each_side_runs_from_its_own_worktree_which_is_removed_even_on_ctrl_c():
    head = C.git("rev-parse", "HEAD")
    with pytest.raises(KeyboardInterrupt):
        with C.worktrees({"base": head}) as trees:
            tree = trees["base"]
            assert (tree / "bench" / "compare.py").exists()
            # The venv's editable install points elsewhere; PYTHONPATH must win in a child.
            assert C.check_import(tree) == str(tree / "src" / "agentbox" / "__init__.py")
            raise KeyboardInterrupt
    assert not tree.parent.exists()
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert str(tree) not in listed
