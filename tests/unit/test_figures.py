"""The measured figures of README.md and docs/*.md are the ones ``benchmarks/figures.py`` renders from
``benchmarks/results/*.json``: its ``--check``, in the default tier, with the controls it must fail."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_FILE = re.compile(r"benchmarks/results/([\w.-]+\.json)")
CITED_WITHOUT_FIGURES = {("docs/tests.md", "libraries.json")}  # the figure rule names the file; it quotes no figure


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("figures", module)  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


figures = _load()
DOCS = sorted({f.doc for f in figures.REGISTRY})


def _copy(tmp_path: Path, docs: list[str] = DOCS) -> Path:
    """The registry's documents under ``tmp_path`` (the results files stay where they are)."""
    for doc in docs:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    return tmp_path


def _problems(root: Path = ROOT, results: Path = RESULTS, registry: object = None) -> list[str]:
    outcomes = figures.examine_all(root, results, figures.REGISTRY if registry is None else registry)
    return [p for o in outcomes for p in o.problems]


def test_every_registered_figure_is_the_one_its_results_file_gives() -> None:
    """``python benchmarks/figures.py --check`` finds nothing: every quoted figure is its file's rendering."""
    assert [] == _problems()


def test_every_results_file_a_document_cites_has_its_figures_registered() -> None:
    """A document naming ``benchmarks/results/NAME.json`` has an entry for that file in the registry, so a figure
    quoted from a new results file does not escape the check (the quick figure's entry is registered ahead)."""
    registered = {(f.doc, f.source) for f in figures.REGISTRY}
    missing = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        doc = str(path.relative_to(ROOT))
        for name in sorted(set(RESULTS_FILE.findall(path.read_text()))):
            if (RESULTS / name).is_file() and (doc, name) not in registered | CITED_WITHOUT_FIGURES:
                missing.append(f"{doc}: {name}")
    assert [] == missing


def test_the_main_check_exits_0_and_reports_the_pending_quick_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """``main(['--check'])`` exits 0 on the repository; an entry whose file is not measured yet prints as pending."""
    assert 0 == figures.main(["--check"])
    out = capsys.readouterr().out
    if not (RESULTS / "quick.json").is_file():
        assert "quick.json" in out and "pending" in out


@pytest.mark.parametrize("doc", DOCS)
def test_a_figure_changed_in_a_document_fails_the_check_and_write_restores_it(tmp_path: Path, doc: str) -> None:
    """Negative control: one digit of a registered figure changed in a copy of ``doc`` is reported with the file, the
    expected and the found text; ``--write`` puts the document back as it was."""
    root = _copy(tmp_path, [doc])
    registry = [f for f in figures.REGISTRY if f.doc == doc and (RESULTS / f.source).is_file()]
    text = (root / doc).read_text()
    figure, m = next((f, m) for f in registry if (m := f.pattern.search(text)) and re.search(r"\d", m.group(1)))
    start = m.start(1) + re.search(r"\d", m.group(1)).start()  # type: ignore[union-attr]
    wrong = text[:start] + str((int(text[start]) + 1) % 10) + text[start + 1:]
    (root / doc).write_text(wrong)
    problems = _problems(root, RESULTS, registry)
    assert 1 == len(problems), problems
    assert problems[0].startswith(f"{doc}: ") and f"benchmarks/results/{figure.source}" in problems[0]
    assert f"expected {m.group(1)!r}" in problems[0] and "found " in problems[0]
    assert [] == figures.write(root, RESULTS, registry)
    assert text == (root / doc).read_text()


def test_a_missing_results_file_fails_unless_the_figure_is_not_quoted_yet(tmp_path: Path) -> None:
    """A registered file that does not exist fails the check; an ``until_measured`` entry is pending (not a failure)
    only while the document does not quote it, and once its file exists the document must hold its sentence."""
    results = tmp_path / "results"
    results.mkdir()
    doc = tmp_path / "README.md"
    plain = figures.Figure("README.md", "the battery takes {s} s here.", "battery.json",
                           lambda d: {"s": figures.fixed(d["wall_s"], 1)})
    quick = figures.Figure("README.md", "`--quick` answers in {quick} s.", "quick.json", figures._quick_seconds,
                           until_measured="python benchmarks/quick_bench.py")
    doc.write_text("Intro: the battery takes 17.6 s here.\n")
    [o1, o2] = figures.examine_all(tmp_path, results, [plain, quick])
    assert 1 == len(o1.problems) and "battery.json does not exist" in o1.problems[0]
    assert () == o2.problems and o2.pending is not None and "quick_bench.py" in o2.pending

    doc.write_text("Intro: `--quick` answers in 6.1 s.\n")  # quoted before its file exists: a failure
    [o] = figures.examine_all(tmp_path, results, [quick])
    assert 1 == len(o.problems) and "quick.json does not exist" in o.problems[0]

    (results / "quick.json").write_text(json.dumps({"median_wall_s": 6.14}))
    doc.write_text("Intro, with no quick sentence.\n")  # measured, not quoted: a failure naming the anchor
    [o] = figures.examine_all(tmp_path, results, [quick])
    assert 1 == len(o.problems) and "no sentence matches" in o.problems[0]
    doc.write_text("Intro: `--quick` answers in 6.1 s.\n")
    assert [] == _problems(tmp_path, results, [quick])


def test_an_ambiguous_anchor_or_an_unreadable_file_is_reported_not_raised(tmp_path: Path) -> None:
    """An anchor matching twice, and a file without the key its render reads, are each one problem, not a crash."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "quick.json").write_text(json.dumps({"seconds": 6.1}))
    (results / "battery.json").write_text(json.dumps({"wall_s": 17.6}))
    (tmp_path / "README.md").write_text("It takes 17.6 s here. It takes 17.6 s here.\n`--quick` answers in 6.1 s.\n")
    twice = figures.Figure("README.md", "takes {s} s here.", "battery.json",
                           lambda d: {"s": figures.fixed(d["wall_s"], 1)})
    quick = figures.Figure("README.md", "`--quick` answers in {quick} s.", "quick.json", figures._quick_seconds)
    problems = _problems(tmp_path, results, [twice, quick])
    assert 2 == len(problems), problems
    assert "2 sentences match" in problems[0] and "cannot render" in problems[1] and "median_wall_s" in problems[1]


def test_an_anchor_matches_across_a_rewrapped_line() -> None:
    """Whitespace in an anchor matches any whitespace: a sentence rewrapped elsewhere keeps its figure found."""
    pattern = figures.compile_anchor("takes {s} s on the {where:text} (median")
    m = pattern.search("the battery takes\n17.6 s on the  built-in model\n(median, 2 cores)")
    assert m is not None and "17.6" == m.group("s") and "built-in model" == m.group("where")


def test_numbers_are_written_as_the_documents_write_them() -> None:
    """Half-up rounding of the decimal figure, scientific notation, an upper bound rounded up, a test time."""
    assert ("0.62", "5.49", "70", "17.6") == (figures.fixed(0.615, 2), figures.fixed(5.485, 2),
                                               figures.fixed(70.3, 0), figures.fixed(17.6, 1))
    assert ("3.7e-02", "8.3e3", "1.36e-08") == (figures.sci(0.036813), figures.sci(8344.1, 1, 1),
                                                figures.sci(1.3586e-08, 2))
    assert ("2.7e-7", "1.0e-6") == (figures.sci_ceil(2.62e-07), figures.sci_ceil(9.96e-07))
    assert "2 min 16 s" == figures.min_s(136.4)


def test_a_logs_pytest_summary_counts_a_failure_among_the_tests_that_ran() -> None:
    """The gpu lane's "passed N of M" reads M as every test that ran: a log with a failure gives 11 of 12."""
    log = "===== 1 failed, 11 passed, 16 skipped in 29.91s =====\n...\n430 passed in 23.20s\n"
    assert {"passed": "11", "of": "12", "s": "29.9"} == figures._gpu_lane(log)
    with pytest.raises(ValueError, match="no pytest summary"):
        figures._gpu_lane("no summary here\n")
