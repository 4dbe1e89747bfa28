"""Compare two commits' benchmarks in one run: base and candidate alternated, a verdict per row.

    .venv/bin/python bench/compare.py BASE [CANDIDATE] [--only a,b] [--rounds N]
                                      [--args 'NAME=-n 100 ...']

Each commit is checked out into a detached git worktree under a temp dir; every benchmark runs
for base and candidate alternately (base, candidate, base, candidate, ... N rounds) so that drift
on the host hits both sides alike. A side runs its own worktree's bench script with
PYTHONPATH=<worktree>/src and this interpreter (the venv's editable install is on sys.path only
after PYTHONPATH; checked before any run). The table compares the medians over rounds of each
row's p50 and p99: p50 may be at most 10 % worse, p99 at most 20 % worse, "worse" meaning higher
for latencies and memory, lower for rates (a row's `better` field, if any, else its unit). For a
rate the row's p99 column holds its worst run.

Exit status: 0 no regression, 1 a row regressed beyond the thresholds, 2 a run failed or left
something behind (the comparison is incomplete), 130 interrupted. Logs and JSON of every run go
to bench/results/compare/ (git-ignored); the worktrees are removed at the end, also on Ctrl-C,
after the running benchmark has cleaned up its server and sandboxes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import run_all  # noqa: E402

P50_TOLERANCE = 0.10
P99_TOLERANCE = 0.20
SIDES = ("base", "candidate")
NOT_BENCHMARKS = ("harness", "run_all", "compare")
# Units whose rows are rates: a higher number is better. Everything else (ms, MiB) is a cost.
_RATE_UNITS = ("/s",)
# An option as argparse prints it in --help: "-n N", "--floor-n FLOOR_N", "--profile".
_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


# ---------------------------------------------------------------- pure logic


def higher_is_better(row: dict[str, Any]) -> bool:
    """A row's direction: its `better` field ("higher"/"lower") if set, else from its unit."""
    if row.get("better") in ("higher", "lower"):
        return row["better"] == "higher"
    return str(row.get("unit", "")).endswith(_RATE_UNITS)


def worse_by(base: float, cand: float, higher: bool) -> float:
    """How much worse the candidate is, as a fraction of base (negative: better)."""
    return (base - cand) / base if higher else (cand - base) / base


@dataclass
class Verdict:
    ratio_p50: float | None
    ratio_p99: float | None
    regressed: bool
    text: str


def judge(
    base_p50: float | None,
    cand_p50: float | None,
    base_p99: float | None,
    cand_p99: float | None,
    higher: bool,
) -> Verdict:
    """The verdict on one row's medians; a missing or non-positive base can not be judged."""
    checks = (
        ("p50", base_p50, cand_p50, P50_TOLERANCE),
        ("p99", base_p99, cand_p99, P99_TOLERANCE),
    )
    ratios: dict[str, float | None] = {}
    bad, better, judged = [], [], 0
    for label, b, c, tol in checks:
        if b is None or c is None or b <= 0:
            ratios[label] = None
            continue
        ratios[label] = c / b
        judged += 1
        w = worse_by(b, c, higher)
        if w > tol:
            bad.append(f"{label} {w:+.0%} worse")
        elif w < -tol:
            better.append(f"{label} {-w:.0%} better")
    if bad:
        text = "**REGRESSED**: " + ", ".join(bad)
    elif not judged:
        text = "n/a (no base value to compare with)"
    elif better:
        text = "ok (" + ", ".join(better) + ")"
    else:
        text = "ok"
    return Verdict(ratios["p50"], ratios["p99"], bool(bad), text)


@dataclass
class RowRuns:
    """One metric's values over the rounds of one side."""

    unit: str
    higher: bool
    p50s: list[float] = field(default_factory=list)
    p99s: list[float] = field(default_factory=list)

    @property
    def p50(self) -> float | None:
        return statistics.median(self.p50s) if self.p50s else None

    @property
    def p99(self) -> float | None:
        return statistics.median(self.p99s) if self.p99s else None


def collect(results: list[dict[str, Any]]) -> dict[str, RowRuns]:
    """Rows by metric over one side's runs (each a benchmark's JSON result)."""
    rows: dict[str, RowRuns] = {}
    for res in results:
        for row in res.get("rows", []):
            r = rows.setdefault(row["metric"], RowRuns(row.get("unit", ""), higher_is_better(row)))
            if isinstance(row.get("p50"), int | float):
                r.p50s.append(float(row["p50"]))
            if isinstance(row.get("p99"), int | float):
                r.p99s.append(float(row["p99"]))
    return rows


@dataclass
class Comparison:
    benchmark: str
    metric: str
    base: RowRuns
    cand: RowRuns
    verdict: Verdict


def compare(
    benchmark: str, base_results: list[dict[str, Any]], cand_results: list[dict[str, Any]]
) -> tuple[list[Comparison], list[str]]:
    """Rows of both sides matched by metric; notes on rows that only one side has."""
    base, cand = collect(base_results), collect(cand_results)
    out, notes = [], []
    for metric, b in base.items():
        c = cand.get(metric)
        if c is None:
            notes.append(f"{benchmark}: only the base has the row {metric!r}")
            continue
        out.append(Comparison(benchmark, metric, b, c, judge(b.p50, c.p50, b.p99, c.p99, c.higher)))
    notes += [f"{benchmark}: only the candidate has the row {m!r}" for m in cand if m not in base]
    return out, notes


def supported_args(argv: list[str], help_text: str) -> tuple[list[str], list[str]]:
    """Split a benchmark's extra arguments into (kept, dropped) by the options its --help lists.

    An older commit's script may lack a knob the newer one has; dropping it (with its value,
    the next word unless that is an option) lets both sides run. Benchmarks take no positional
    arguments, so a word after an unknown option is its value.
    """
    known = set(_OPTION.findall(help_text))
    kept, dropped = [], []
    i = 0
    while i < len(argv):
        word = argv[i]
        takes = [word]
        if (
            _is_option(word)
            and "=" not in word
            and i + 1 < len(argv)
            and not _is_option(argv[i + 1])
        ):
            takes.append(argv[i + 1])
        if _is_option(word) and word.split("=", 1)[0] not in known:
            dropped += takes
        else:
            kept += takes
        i += len(takes)
    return kept, dropped


def _is_option(word: str) -> bool:
    return bool(re.match(r"--?[A-Za-z]", word))


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}×"


def table(rows: list[Comparison]) -> str:
    lines = [
        "| benchmark | metric | unit | base p50 | cand p50 | ratio | base p99 | cand p99 "
        "| ratio | verdict | p50 per run: base; cand |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        runs = (
            ", ".join(fmt(v) for v in c.base.p50s) + "; " + ", ".join(fmt(v) for v in c.cand.p50s)
        )
        better = "higher" if c.cand.higher else "lower"
        lines.append(
            f"| {c.benchmark} | {c.metric} | {c.cand.unit} ({better} is better) "
            f"| {fmt(c.base.p50)} | {fmt(c.cand.p50)} | {fmt_ratio(c.verdict.ratio_p50)} "
            f"| {fmt(c.base.p99)} | {fmt(c.cand.p99)} | {fmt_ratio(c.verdict.ratio_p99)} "
            f"| {c.verdict.text} | {runs} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- worktrees and runs


def git(*argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(H.ROOT), *argv], check=True, capture_output=True, text=True
    ).stdout.strip()


@contextmanager
def worktrees(commits: dict[str, str]) -> Iterator[dict[str, Path]]:
    """A detached worktree per side under one temp dir, removed on the way out."""
    tmp = Path(tempfile.mkdtemp(prefix="agentbox-compare-"))
    paths: dict[str, Path] = {}
    try:
        for side, sha in commits.items():
            paths[side] = tmp / side
            git("worktree", "add", "--detach", "--quiet", str(paths[side]), sha)
        yield paths
    finally:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the removal finish
        try:
            for path in paths.values():
                subprocess.run(
                    ["git", "-C", str(H.ROOT), "worktree", "remove", "--force", str(path)],
                    capture_output=True,
                )
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["git", "-C", str(H.ROOT), "worktree", "prune"], capture_output=True)
        finally:
            signal.signal(signal.SIGINT, old)


def side_env(tree: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree / "src"))


def check_import(tree: Path) -> str:
    """Where a child on this side imports agentbox from; it must be the worktree's own src."""
    out = subprocess.run(
        [H.PYTHON, "-c", "import agentbox; print(agentbox.__file__)"],
        env=side_env(tree),
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=60,
    )
    where = out.stdout.strip()
    if out.returncode != 0 or not where.startswith(str(tree / "src") + "/"):
        raise SystemExit(
            f"a child with PYTHONPATH={tree / 'src'} imports agentbox from "
            f"{where or out.stderr.strip()!r}, not from that worktree; stopping"
        )
    return where


def bench_help(tree: Path, name: str) -> str:
    out = subprocess.run(
        [H.PYTHON, str(tree / "bench" / f"{name}.py"), "--help"],
        env=side_env(tree),
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


def run_child(argv: list[str], tree: Path, log_path: Path) -> int:
    """Run one benchmark to its end; on Ctrl-C or SIGTERM, let it clean up first.

    The child gets its own session so that a terminal's Ctrl-C reaches only this process,
    which then sends the child exactly one SIGINT: a second one could cut short the cleanup
    of its server and sandboxes.
    """
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            argv,
            env=side_env(tree),
            cwd=tree,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return p.wait()
    except KeyboardInterrupt:
        print(
            f"# interrupted: waiting for {Path(argv[1]).stem} to clean up ...",
            file=sys.stderr,
            flush=True,
        )
        p.send_signal(signal.SIGINT)
        while True:
            try:
                p.wait()
                break
            except KeyboardInterrupt:
                print("# still cleaning up; waiting", file=sys.stderr, flush=True)
        raise


@dataclass
class Plan:
    names: list[str]
    rounds: int
    extra: dict[str, list[str]]
    out_dir: Path
    results: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_one(plan: Plan, trees: dict[str, Path], shas: dict[str, str], name: str) -> None:
    """One benchmark, base and candidate alternated for plan.rounds rounds."""
    argvs: dict[str, list[str]] = {}
    for side in SIDES:
        script = trees[side] / "bench" / f"{name}.py"
        if not script.exists():
            plan.notes.append(f"{name}: skipped, {side} {shas[side][:7]} has no {script.name}")
            return
        args, dropped = supported_args(plan.extra.get(name, []), bench_help(trees[side], name))
        if dropped:
            plan.notes.append(
                f"{name}: {side} {shas[side][:7]} does not take {' '.join(dropped)}; run without it"
            )
        argvs[side] = [H.PYTHON, str(script), *args]
    plan.results[name] = {side: [] for side in SIDES}
    for rnd in range(1, plan.rounds + 1):
        for side in SIDES:
            stem = plan.out_dir / f"{name}-r{rnd}-{side}-{shas[side][:7]}"
            js = stem.with_suffix(".json")
            js.unlink(missing_ok=True)
            print(
                f"# {name} round {rnd}/{plan.rounds}: {side} {shas[side][:7]} ...",
                file=sys.stderr,
                flush=True,
            )
            rc = run_child([*argvs[side], "--json", str(js)], trees[side], stem.with_suffix(".txt"))
            if rc != 0 or not js.exists():
                plan.failures.append(
                    f"{name} round {rnd} {side}: exit {rc} (output in {stem.with_suffix('.txt')})"
                )
                continue
            res = json.loads(js.read_text())
            if any(res.get("leftovers", {}).values()):
                plan.failures.append(
                    f"{name} round {rnd} {side}: left things behind: {res['leftovers']}"
                )
            plan.results[name][side].append(res)


def parse_extra(items: list[str]) -> dict[str, list[str]]:
    extra: dict[str, list[str]] = {}
    for item in items:
        name, sep, words = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--args takes NAME=ARGS (e.g. 'exec_latency=-n 100'), not {item!r}")
        extra.setdefault(name, []).extend(shlex.split(words))
    return extra


def report(plan: Plan, shas: dict[str, str], imports: dict[str, str], mach: dict[str, Any]) -> int:
    rows: list[Comparison] = []
    for name, sides in plan.results.items():
        found, notes = compare(name, sides["base"], sides["candidate"])
        rows += found
        plan.notes += notes
    print("# agentbox benchmarks: base vs candidate, same run\n")
    print(f"- date: {mach['date']} to {H.machine()['date']}")
    print(f"- machine: {H.machine_line(mach)}; load at the end {' '.join(H.machine()['loadavg'])}")
    for side in SIDES:
        print(
            f"- {side}: `{shas[side][:7]}` {git('log', '-1', '--format=%s', shas[side])[:100]}"
            f" (agentbox from {imports[side]})"
        )
    print(f"- command: `.venv/bin/python bench/compare.py {shlex.join(sys.argv[1:])}`")
    print(
        f"- {plan.rounds} round(s) per benchmark, base and candidate alternated; medians over "
        f"rounds; p50 within {P50_TOLERANCE:.0%}, p99 within {P99_TOLERANCE:.0%}\n"
    )
    print(table(rows))
    for note in plan.notes:
        print(f"\n- {note}", end="")
    if plan.failures:
        print("\n\nFAILED: " + "; ".join(plan.failures), end="")
    print(
        f"\n\nbwrap processes on the host after the run: {H.host_bwrap_count()} "
        "(includes other servers' sandboxes, if any)"
    )
    if plan.failures:
        return 2
    return 1 if any(r.verdict.regressed for r in rows) else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", help="the commit to compare against (e.g. 48a218c)")
    p.add_argument("candidate", nargs="?", default="HEAD", help="the new commit (default HEAD)")
    p.add_argument("--only", help="comma-separated subset of: " + ", ".join(run_all.BENCHMARKS))
    p.add_argument("--rounds", type=int, default=2, help="runs per side (default 2)")
    p.add_argument(
        "--args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra arguments for one benchmark, e.g. 'exec_latency=-n 100' "
        "(repeatable; options a side's script lacks are dropped for that side)",
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        shas = {
            "base": git("rev-parse", "--verify", args.base + "^{commit}"),
            "candidate": git("rev-parse", "--verify", args.candidate + "^{commit}"),
        }
    except subprocess.CalledProcessError as e:
        p.error(f"not a commit: {e.stderr.strip()}")
    names = args.only.split(",") if args.only else list(run_all.BENCHMARKS)
    unknown = [
        n for n in names if n in NOT_BENCHMARKS or not (H.ROOT / "bench" / f"{n}.py").exists()
    ]
    if unknown:
        p.error(f"no such benchmark: {', '.join(unknown)}")
    plan = Plan(
        names, args.rounds, parse_extra(args.args), H.ROOT / "bench" / "results" / "compare"
    )
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    H._install_signal_handlers()  # SIGTERM/SIGHUP end the run like Ctrl-C, cleanly
    mach = H.machine()
    try:
        with worktrees(shas) as trees:
            imports = {side: check_import(trees[side]) for side in SIDES}
            for name in plan.names:
                run_one(plan, trees, shas, name)
    except KeyboardInterrupt:
        print("# interrupted; worktrees removed", file=sys.stderr)
        sys.exit(130)
    sys.exit(report(plan, shas, imports, mach))


if __name__ == "__main__":
    main()
