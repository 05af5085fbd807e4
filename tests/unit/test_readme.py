"""The README's figures come from results files, its library table is the one ``benchmarks/library_table.py`` renders,
and every relative link in README.md and ``docs/*.md`` points at a file (and heading) that exists.

The rule for figures (also in docs/tests.md, "The README's figures"):

- A *measured figure* is a number written as a duration (``22 s``, ``0.078 s``, ``2 min 01 s``), a ratio (``70x``),
  a percentage (``26.48%``), a test count (``1172 passed``, ``92 skipped``) or a number in scientific notation with a
  decimal point (``1.0e-02``). Nothing else is a measurement, so nothing else is checked: the seed's arithmetic (12,
  36, 2, 2.5, 48), option defaults (``default 12``), tolerances without a decimal point (``atol 1e-6``), versions,
  durations written in words ("30 seconds").
- A *block* is a paragraph, a list item, a table or a fenced code block; a table or code block also counts the
  paragraph (or list item) right before it, its caption, as its own.
- Every measured figure sits in a block that names ``benchmarks/results/NAME.json``, and some value of one of the files
  its block names lies within half a unit of the figure's last digit: a numeric leaf of the JSON, or a number inside
  one of its strings (``0.078`` matches 0.0781, ``1.0e-02`` 0.01012, ``2 min 01 s`` = 121 s anything in 120.5..121.5,
  ``70x`` 70.3; a percentage also matches its fraction). A ratio is never computed from two values: the file holds it,
  or the README does not state it.

The Quick start's test time is checked apart (:func:`suite_problems`): it states ``median_wall_s`` of
``benchmarks/results/suite.json`` as ``M min SS s`` and how many tests its runs judged (any outcome).
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
DOCS = sorted((ROOT / "docs").rglob("*.md"))

RESULTS_FILE = re.compile(r"benchmarks/results/([\w.-]+\.json)")
FIGURE = re.compile(r"""(?<![\w.])(?:
      (?P<min>\d+)\ min(?:\ (?P<min_s>\d{1,2})\ s)?\b
    | (?P<sci>\d\.\d+)e(?P<exp>[-+]?\d+)\b
    | (?P<dur>\d+(?:\.\d+)?)\ ?(?P<unit>ms|s)\b
    | (?P<ratio>\d+(?:\.\d+)?)x\b
    | (?P<pct>\d+(?:\.\d+)?)%
    | (?P<count>\d+)\ (?:passed|skipped|failed|errors?|deselected|xfailed|xpassed)\b
    )""", re.VERBOSE)
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+\.)\s")
KIND = {"paragraph": "paragraph", "item": "list item", "table": "table", "code": "code block", "heading": "heading"}


@dataclass(frozen=True)
class Block:
    """A paragraph, list item, table, fenced code block or heading of a markdown text."""

    kind: str  # "paragraph", "item", "table", "code", "heading"
    line: int  # where it starts, 1-based
    text: str
    caption: str = ""  # for a table or code block: the paragraph or list item right before it

    @property
    def names(self) -> list[str]:
        """The results files this block (with its caption) names."""
        return sorted(set(RESULTS_FILE.findall(self.caption + "\n" + self.text)))


@dataclass(frozen=True)
class Figure:
    """A measured figure as written, its value (seconds for a duration) and half a unit of its last digit."""

    text: str
    value: float
    half_unit: float
    also: float | None = None  # a percentage's fraction

    def matches(self, values: list[float]) -> bool:
        targets = [self.value] if self.also is None else [self.value, self.also]
        return any(abs(x - t) <= h * (1 + 1e-9) for x in values
                   for t, h in zip(targets, [self.half_unit, self.half_unit / 100]))


def _half(number: str) -> float:
    """Half a unit of the last digit of a decimal number as written."""
    decimals = len(number.split(".")[1]) if "." in number else 0
    return 0.5 * 10.0 ** -decimals


def figures(text: str) -> list[Figure]:
    """Every measured figure in ``text`` (the module docstring says what counts as one)."""
    out = []
    for m in FIGURE.finditer(text):
        g = m.groupdict()
        if g["min"] is not None:
            seconds = int(g["min"]) * 60 + int(g["min_s"] or 0)
            out.append(Figure(m.group(0), float(seconds), 0.5 if g["min_s"] else 30.0))
        elif g["sci"] is not None:
            decimals = len(g["sci"].split(".")[1])
            out.append(Figure(m.group(0), float(m.group(0)), 0.5 * 10.0 ** (int(g["exp"]) - decimals)))
        elif g["dur"] is not None:
            scale = 1e-3 if g["unit"] == "ms" else 1.0
            out.append(Figure(m.group(0), float(g["dur"]) * scale, _half(g["dur"]) * scale))
        elif g["ratio"] is not None:
            out.append(Figure(m.group(0), float(g["ratio"]), _half(g["ratio"])))
        elif g["pct"] is not None:
            out.append(Figure(m.group(0), float(g["pct"]), _half(g["pct"]), also=float(g["pct"]) / 100))
        else:
            out.append(Figure(m.group(0), float(g["count"]), 0.5))
    return out


def blocks(text: str) -> list[Block]:
    """``text`` cut into blocks; a table or code block carries the paragraph or list item right before it."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        start = i
        if not line.strip():
            i += 1
            continue
        if line.lstrip().startswith("```"):
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                i += 1
            i += 1
            kind = "code"
        elif line.startswith("#"):
            i += 1
            kind = "heading"
        elif line.lstrip().startswith("|"):
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                i += 1
            kind = "table"
        else:
            kind = "item" if LIST_ITEM.match(line) else "paragraph"
            i += 1
            while (i < len(lines) and lines[i].strip() and not LIST_ITEM.match(lines[i])
                   and not lines[i].lstrip().startswith(("```", "|", "#"))):
                i += 1
        caption = ""
        if kind in ("table", "code") and out and out[-1].kind in ("paragraph", "item"):
            caption = out[-1].text
        out.append(Block(kind, start + 1, "\n".join(lines[start:i]), caption))
    return out


def leaves(data: Any) -> list[float]:
    """Every number of a parsed JSON document: its numeric leaves and the numbers inside its strings."""
    out: list[float] = []
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, bool) or x is None:
            continue
        if isinstance(x, (int, float)):
            out.append(float(x))
        elif isinstance(x, str):
            out.extend(float(n) for n in NUMBER.findall(x))
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return out


def figure_problems(text: str, results: Path = RESULTS) -> list[str]:
    """What breaks the figure rule in ``text``: a measured figure in a block that names no results file, a named
    results file that does not exist, a figure that matches no value of the files its block names."""
    problems = []
    for block in blocks(text):
        found = figures(block.text)
        if not found:
            continue
        where = f"line {block.line}"
        names = block.names
        if not names:
            problems.append(f"{where}: {', '.join(repr(f.text) for f in found)} in a {KIND[block.kind]} that names no "
                            "benchmarks/results/NAME.json (move the figure to docs/, or cite the file that holds it)")
            continue
        values: list[float] = []
        for name in names:
            path = results / name
            if not path.is_file():
                problems.append(f"{where}: names benchmarks/results/{name}, which does not exist")
                continue
            values += leaves(json.loads(path.read_text()))
        if not values:
            continue
        for figure in found:
            if not figure.matches(values):
                problems.append(f"{where}: {figure.text!r} matches no value of {', '.join(names)} at the precision "
                                "it is written with")
    return problems


SUITE_SENTENCE = re.compile(r"`bash scripts/test\.sh` from a fresh clone: (?P<passed>\S+) tests in (?P<time>.+?) "
                            r"\(median of the runs in `?benchmarks/results/suite\.json`?\)")


def min_s(seconds: float) -> str:
    """``seconds`` as the README writes a test time: ``M min SS s``, rounded to the second."""
    whole = int(seconds + 0.5)
    return f"{whole // 60} min {whole % 60:02d} s"


OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "errors")


def _passed(run: dict[str, Any]) -> Any:
    """How many tests a run judged, whatever their outcome (pytest's summary as ``benchmarks/suite_bench.py``
    writes it, ``counts``; deselected ones left out): a test that skips until its results file exists and passes
    after leaves the number where it was."""
    counts = run.get("counts") or {k: run[k] for k in OUTCOMES if k in run}
    return sum(int(v) for k, v in counts.items() if k in OUTCOMES) or None


def suite_problems(text: str, suite: dict[str, Any] | None) -> list[str]:
    """What is wrong with the Quick start's test-time sentence against ``suite`` (the parsed suite.json; None when
    the file does not exist): it states ``median_wall_s`` as ``M min SS s`` and the passed count every run had."""
    m = SUITE_SENTENCE.search(" ".join(text.split()))
    if m is None:
        return ["no sentence '`bash scripts/test.sh` from a fresh clone: N tests in M min SS s (median of the runs "
                "in benchmarks/results/suite.json)'"]
    if suite is None:
        return ["benchmarks/results/suite.json does not exist yet: EXPECTED until the suite's runs are measured; "
                f"then fill in the sentence {m.group(0)!r}"]
    problems = []
    if suite.get("schema") != "harness.suite/1":
        problems.append(f"suite.json's schema is {suite.get('schema')!r}, not 'harness.suite/1'")
    runs = suite.get("runs") or []
    median = suite.get("median_wall_s")
    if not runs or not isinstance(median, (int, float)):
        return [*problems, "suite.json needs 'runs' (each with 'wall_s' and 'passed' or 'counts': {'passed'}) and "
                "'median_wall_s'"]
    if abs(statistics.median(r["wall_s"] for r in runs) - median) > 0.5:
        problems.append(f"median_wall_s {median} is not the median of the runs' wall_s")
    if m["time"] != min_s(median):
        problems.append(f"the README says {m['time']!r}; suite.json's median_wall_s {median} is {min_s(median)!r}")
    passed = sorted({_passed(r) for r in runs}, key=str)
    if len(passed) != 1:
        problems.append(f"the runs in suite.json disagree on how many tests ran: {passed}")
    elif m["passed"] != str(passed[0]):
        problems.append(f"the README says {m['passed']} tests; every run in suite.json has {passed[0]}")
    return problems


def _library_table() -> Any:
    spec = importlib.util.spec_from_file_location("library_table", ROOT / "benchmarks" / "library_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_problems(text: str, expected: str) -> list[str]:
    """How the README's library table (the table whose header starts ``| library configuration``) differs from
    ``expected``, row by row."""
    tables = [b for b in blocks(text) if b.kind == "table" and b.text.startswith("| library configuration")]
    if len(tables) != 1:
        return [f"{len(tables)} library tables in the README, not 1"]
    got, want = tables[0].text.splitlines(), expected.splitlines()
    problems = [f"table line {i + 1}: the README has {g!r}, markdown() renders {w!r}"
                for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if len(got) != len(want):
        problems.append(f"the README's table has {len(got)} lines, markdown() renders {len(want)}")
    return problems


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for block in blocks(text):
        if block.kind == "heading":
            base = slug(block.text.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """Relative links in the markdown file ``path`` (or in ``text`` as if it were that file) whose target file, or
    whose ``#anchor`` in a markdown target, does not exist. Code blocks and inline code are not read."""
    text = path.read_text() if text is None else text
    prose = "\n".join(b.text for b in blocks(text) if b.kind != "code")
    prose = re.sub(r"`[^`]*`", "", prose)
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-zA-Z][\w+.-]*:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{path.name}: ({target}) points at {dest}, which does not exist")
        elif anchor and dest.suffix == ".md":
            own = text if dest == path else dest.read_text()
            if anchor not in anchors(own):
                problems.append(f"{path.name}: ({target}) names no heading of {dest.name}")
    return problems


def _block_naming(name: str, kind: str) -> Block:
    found = [b for b in blocks(README.read_text()) if b.kind == kind and name in b.names and figures(b.text)]
    assert found, f"the README has no {kind} with figures naming benchmarks/results/{name}"
    return found[0]


def test_every_readme_figure_is_in_its_results_file() -> None:
    """Every measured figure in the README sits in a block naming its results file and matches one of its values."""
    assert [] == figure_problems(README.read_text())


def test_quick_start_states_the_median_of_suite_json() -> None:
    """The Quick start's test time is suite.json's median_wall_s as ``M min SS s``, and its count of tests every
    run's. Skipped where the file is not there (a clone measuring itself with ``benchmarks/suite_bench.py``)."""
    path = RESULTS / "suite.json"
    if not path.is_file():
        pytest.skip("benchmarks/results/suite.json is not measured yet: python benchmarks/suite_bench.py")
    assert [] == suite_problems(README.read_text(), json.loads(path.read_text()))


def test_readme_library_table_is_the_rendering_of_libraries_json() -> None:
    """The README's table is ``benchmarks/library_table.py``'s ``markdown()`` of benchmarks/results/libraries.json."""
    result = json.loads((RESULTS / "libraries.json").read_text())
    assert [] == table_problems(README.read_text(), _library_table().markdown(result))


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(path: Path) -> None:
    """Every relative link (and its #anchor, in a markdown file) of README.md and docs/*.md exists."""
    assert [] == link_problems(path)


def test_the_readme_links_every_docs_file() -> None:
    """The README's Documentation index names every file of docs/."""
    linked = {(ROOT / target).resolve() for target in LINK.findall(README.read_text())}
    assert [] == [str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in linked]


def test_a_readme_figure_with_one_digit_changed_is_rejected() -> None:
    """Negative control: the README's verdict excerpt with one digit of its first figure changed fails the rule."""
    block = _block_naming("libraries.json", "code")
    first = figures(block.text)[0].text  # '1.0e-02'
    wrong = first[0] + "." + str((int(first[2]) + 5) % 10) + first[3:]  # '1.5e-02'
    text = block.caption + "\n\n" + block.text.replace(first, wrong, 1)
    assert [] == figure_problems(block.caption + "\n\n" + block.text)
    problems = figure_problems(text)
    assert len(problems) == 1 and repr(wrong) in problems[0], problems


def test_a_figure_outside_a_block_naming_a_results_file_is_rejected() -> None:
    """Negative control: a measured time in a sentence that names no results file fails; the seed's arithmetic and
    option defaults are not measurements."""
    assert ["line 1"] == [p.split(":")[0] for p in figure_problems("The battery took 103.5 s on two cores.\n")]
    why = "Rank 0 holds 12 tokens, rank 1 holds 36: 2, not (12 + 108) / 48 = 2.5; `--battery-examples N` (default 12)."
    assert [] == figures(why)
    assert ["2 min 01 s", "0.078 s", "70x", "1.0e-02", "1172 passed", "26.48%"] == [
        f.text for f in figures("2 min 01 s, 0.078 s, 70x, 1.0e-02, 1172 passed, 26.48%")]


def test_figures_match_at_the_precision_they_are_written_with(tmp_path: Path) -> None:
    """``0.078`` matches 0.0781, ``1.0e-02`` 0.01012, ``2 min 01 s`` 120.6 and ``70x`` 70.3; one digit off does not."""
    (tmp_path / "x.json").write_text(json.dumps({"a": 0.0781, "b": [0.01012, {"c": 120.6}], "d": "ratio 70.3"}))
    right = "`benchmarks/results/x.json`: 0.078 s, 1.0e-02, 2 min 01 s, 70x.\n"
    assert [] == figure_problems(right, tmp_path)
    for wrong in ("0.079 s", "1.1e-02", "2 min 02 s", "71x"):
        assert 1 == len(figure_problems(f"`benchmarks/results/x.json`: {wrong}.\n", tmp_path)), wrong
    assert ["line 1: names benchmarks/results/y.json, which does not exist"] == figure_problems(
        "benchmarks/results/y.json: 3 s\n", tmp_path)


def test_the_suite_sentence_is_checked_against_its_median() -> None:
    """Negative control of the suite check: the right median and count pass; a second off, the placeholder, or a
    missing file do not."""
    suite = {"schema": "harness.suite/1", "median_wall_s": 280.4,
             "runs": [{"wall_s": 279.0, "passed": 1080, "skipped": 92},
                      {"wall_s": 280.4, "passed": 1081, "skipped": 91},
                      {"wall_s": 283.1, "counts": {"passed": 1080, "skipped": 92, "deselected": 120}}]}
    sentence = "`bash scripts/test.sh` from a fresh clone: {} tests in {} (median of the runs in {})."
    path = "benchmarks/results/suite.json"
    assert [] == suite_problems(sentence.format(1172, "4 min 40 s", path), suite)
    assert 1 == len(suite_problems(sentence.format(1172, "4 min 41 s", path), suite))
    assert 1 == len(suite_problems(sentence.format(1171, "4 min 40 s", path), suite))
    assert 2 == len(suite_problems(sentence.format("N", "M min SS s", path), suite))
    assert "EXPECTED" in suite_problems(sentence.format(1172, "4 min 40 s", path), None)[0]


def test_a_changed_library_table_cell_is_rejected() -> None:
    """Negative control: the README with one cell of its library table changed differs from markdown()."""
    result = json.loads((RESULTS / "libraries.json").read_text())
    expected = _library_table().markdown(result)
    text = README.read_text()
    cell = re.search(r"\| FAIL (\d)\.(\d)e-(\d\d) \|", text[text.index("| library configuration |"):])
    assert cell is not None, "the library table has no FAIL cell with a figure to change"
    digit = str((int(cell.group(2)) + 1) % 10)
    changed = text.replace(cell.group(0), f"| FAIL {cell.group(1)}.{digit}e-{cell.group(3)} |", 1)
    assert changed != text
    assert 1 == len(table_problems(changed, expected))


def test_a_link_to_a_missing_file_or_heading_is_rejected() -> None:
    """Negative control: a relative link to a file that does not exist, or to a heading a file lacks, is reported."""
    text = ("See [the commands](docs/commands.md), [nothing](docs/no-such-file.md), [a heading](docs/commands.md#"
            "no-such-heading), [the web](https://example.org/x.md) and `[code](missing.md)`.\n")
    problems = link_problems(README, text)
    assert 2 == len(problems), problems
    assert "no-such-file.md" in problems[0] and "no-such-heading" in problems[1]
