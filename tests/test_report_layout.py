"""The report fits a 1,400 px page (issue 31, item 5): outcome and dynamics tables whose
estimated width, from their column count and longest cell lines, fits the page, and which
headless Chromium, where it is installed, measures as fitting; the plots of work,
throughput, step times and accuracy; and which worker evaluates. Without a browser the
HTML is parsed and each table's natural width is estimated from its text."""

from __future__ import annotations

import html as htmllib
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from paramserver.workers.experiments.render import DYNAMICS_COLUMNS, OUTCOME_COLUMNS
from paramserver.workers.experiments.report import ReportFiles, write_report
from tests.test_report import CONFIGS, GOOD, fake_experiment

#: the page a reader sees; the body's content is 1,300 px wide within it (report CSS)
PAGE_PX = 1400
BODY_PX = 1300
#: the tables' font: 0.9 x 16 px; a character of system-ui text is about 0.55 em wide,
#: 0.6 em counted (bold headers are wider); <small> is 0.8 of that
CHAR_PX = 0.6 * 0.9 * 16
SMALL = 0.8
#: a cell's horizontal padding (0.6 em each side at 0.9 x 16 px) and its border
CELL_PAD_PX = 2 * 0.6 * 0.9 * 16 + 1


class _Tables(HTMLParser):
    """Every <table>: its rows, each cell a list of (line text, in <small>) lines."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[list[tuple[str, bool]]]]] = []
        self._cell: list[tuple[str, bool]] | None = None
        self._small = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = [("", False)]
            self.tables[-1][-1].append(self._cell)
        elif tag == "br" and self._cell is not None:
            self._cell.append(("", False))
        elif tag == "small":
            self._small = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th"):
            self._cell = None
        elif tag == "small":
            self._small = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            text, _ = self._cell[-1]
            self._cell[-1] = (text + data, self._small)


def _line_px(line: tuple[str, bool]) -> float:
    text, small = line
    return len(text) * CHAR_PX * (SMALL if small else 1.0)


def _width(table: list[list[list[tuple[str, bool]]]]) -> tuple[int, float]:
    """(columns, estimated natural width): each column as wide as its longest line."""
    columns = max(len(row) for row in table)
    widths = [max(_line_px(line) for row in table if i < len(row) for line in row[i])
              for i in range(columns)]
    return columns, sum(widths) + columns * CELL_PAD_PX


def _scale_labels(out: Path, suffix: str) -> None:
    """Longer configuration labels, as a policy with arguments gives them."""
    path = out / "experiment.json"
    exp = json.loads(path.read_text())
    for config in exp["configurations"]:
        config["label"] += suffix
    path.write_text(json.dumps(exp))


@pytest.fixture(scope="module", params=[1.0, 0.002])  # rates of ~10/s and of thousands/s
def wide_report(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[float, ReportFiles]:
    """A report with wide cells (long labels, spreads over seeds, a failed run), built once
    for the estimate and for the browser."""
    scale: float = request.param
    out = tmp_path_factory.mktemp("wide-report")
    fake_experiment(out, dts={k: v * scale for k, v in GOOD.items()}, gap=1,
                    failed=("transient-async-none-w2", 2))
    _scale_labels(out, " + gap-aware")
    return scale, write_report(out)


def test_every_table_fits_the_page(wide_report: tuple[float, ReportFiles]) -> None:
    scale, files = wide_report
    parser = _Tables()
    parser.feed(files.html.read_text())
    # per scenario an outcome and a dynamics table, every configuration in each
    assert len(parser.tables) == 2 * 2
    counts = [len(OUTCOME_COLUMNS) + 1, len(DYNAMICS_COLUMNS) + 1] * 2
    for table, columns in zip(parser.tables, counts, strict=True):
        assert len(table) == 1 + len(CONFIGS)
        assert all(len(row) == columns for row in table)
        cols, width = _width(table)
        assert cols == columns and width < BODY_PX < PAGE_PX, (cols, width)
    # the cells do say something wide: the spread over seeds of large rates
    spreads = [line for table in parser.tables for row in table[1:] for cell in row
               for line in cell if line[1] and line[0].startswith("[")]
    assert spreads and max(len(text) for text, _ in spreads) >= (13 if scale < 1 else 9)
    # every column of the old single table is in one of the two, by its full name in md
    md = files.markdown.read_text()
    for c in OUTCOME_COLUMNS + DYNAMICS_COLUMNS:
        assert f"| {c.title} |" in md
    html = files.html.read_text()
    for c in OUTCOME_COLUMNS + DYNAMICS_COLUMNS:  # the legend names every short header
        if c.short.replace("\n", " ") != c.title:
            assert f"{c.short.replace(chr(10), ' ')}: {c.title}" in html


def test_the_widths_estimate_would_catch_the_old_single_table() -> None:
    """The 17 columns of one table, at the same cell texts, are over the page."""
    head = [[("configuration", False)]] + [[(c.title, False)]
                                           for c in OUTCOME_COLUMNS + DYNAMICS_COLUMNS]
    row = [[("ssp s=3 + gap-aware", False)]] + [[("1234.5 [1200.1-1250.3]", False)]] * 16
    _, width = _width([head, row])
    assert width > PAGE_PX


def _chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


#: run on load: each table's width as shown and at its natural width (max-content: no
#: line broken but at its <br>), the page's, and a control table, the old single one
_MEASURE = """<script>
addEventListener("load", () => {
  const natural = (t) => {
    t.style.maxWidth = "none"; t.style.width = "max-content";
    const w = t.getBoundingClientRect().width;
    t.style.maxWidth = ""; t.style.width = "";
    return w;
  };
  const page = document.documentElement.clientWidth;
  const scroll = document.documentElement.scrollWidth;
  const body = parseFloat(getComputedStyle(document.body).width);
  const tables = [...document.querySelectorAll("table")].map((t) => {
    const shown = t.getBoundingClientRect();
    return {shown: shown.width, right: shown.right, natural: natural(t)};
  });
  const control = document.createElement("table");
  control.innerHTML = CONTROL;
  document.body.append(control);
  const old = natural(control);
  control.remove();
  const out = document.createElement("pre");
  out.id = "layout";
  out.textContent = JSON.stringify({page, scroll, body, tables, old});
  document.body.append(out);
});
</script>"""


def _old_single_table() -> str:
    """The 17 columns of the table before the split, with cells as the report writes them."""
    head = "".join(f"<th>{htmllib.escape(c.title)}</th>"
                   for c in OUTCOME_COLUMNS + DYNAMICS_COLUMNS)
    cell = "<td>1234.5<br><small>[1200.1-1250.3]</small></td>"
    return (f"<thead><tr><th>configuration</th>{head}</tr></thead>"
            f"<tbody><tr><td>ssp s=3 + gap-aware</td>{cell * 16}</tr></tbody>")


@pytest.mark.timeout(120)
def test_chromium_shows_every_table_within_the_page(
        wide_report: tuple[float, ReportFiles], tmp_path: Path) -> None:
    """The report in headless Chromium at 1,400 px: the browser's own measure of every
    table, as shown and at its natural width, against the page."""
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium, chromium-browser or google-chrome on PATH "
                    "(apt-get install chromium)")
    _, files = wide_report
    page = tmp_path / "report.html"
    script = _MEASURE.replace("CONTROL", json.dumps(_old_single_table()))
    page.write_text(files.html.read_text().replace("</body>", script + "</body>"))
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu",
         f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={PAGE_PX},1000",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=60, check=True).stdout
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    layout = json.loads(htmllib.unescape(found.group(1)))
    # the page is the window less a scrollbar, if it shows one; nothing scrolls sideways
    assert PAGE_PX - 20 <= layout["page"] <= PAGE_PX
    assert layout["scroll"] <= layout["page"]
    assert len(layout["tables"]) == 2 * 2
    for table in layout["tables"]:  # shown whole, and not squeezed: no cell line broken
        assert table["shown"] <= layout["body"] < layout["page"], layout
        assert table["right"] <= layout["page"], layout
        assert table["natural"] <= layout["body"], layout
    assert layout["old"] > layout["page"]  # the measure does catch a table that is too wide


def test_new_plots_are_written_and_linked(tmp_path: Path) -> None:
    fake_experiment(tmp_path, dts=GOOD, scenarios=("none",), seeds=(0, 1))
    files = write_report(tmp_path)
    md = files.markdown.read_text()
    names = {p.name for p in files.images}
    for name in ("none-work.png", "none-throughput.png", "none-step-times.png",
                 "none-accuracy.png"):
        assert name in names
        assert f"](images/{name})" in md
        assert (tmp_path / "images" / name).read_bytes()[:4] == b"\x89PNG"
    assert files.html.read_text().count("data:image/png;base64,") == len(files.images)


def test_work_curve_counts_gradients_and_samples_at_each_evaluation(tmp_path: Path) -> None:
    from paramserver.workers.experiments.report import load_run, run_metrics
    from tests.test_report import fake_run

    fake_run(tmp_path, workers=2, steps=6, dt=0.1, final={"loss": 1.0, "accuracy": 0.75})
    m = run_metrics(load_run(tmp_path), seed=0, target_loss=1.65)
    # worker 0 evaluates before each of its steps: after 2k steps of 32 samples, then the
    # final evaluation after all 12
    assert m.evaluator == 0
    assert [(g, n) for g, n, _ in m.work_curve] == [(2.0 * k, 64.0 * k) for k in range(6)] \
        + [(12.0, 384.0)]
    assert [loss for _, _, loss in m.work_curve] == [loss for _, _, loss in m.curve]
    assert [a for _, a in m.accuracy_curve] == [0.5] * 6
    # every worker steps every 0.2 s after its first; worker 0 started 0.05 s before T0
    assert m.step_times[1][1:] == pytest.approx([0.2] * 5)
    assert m.step_times[0][0] == pytest.approx(0.151)
    assert [v for _, v in m.versions] == sorted(v for _, v in m.versions)


@pytest.mark.parametrize("straggler", [0, 1])
def test_the_report_names_the_evaluator_and_whether_it_is_the_straggler(
        tmp_path: Path, straggler: int) -> None:
    fake_experiment(tmp_path, dts=GOOD, scenarios=("none",), seeds=(0,))
    path = tmp_path / "experiment.json"
    exp = json.loads(path.read_text())
    exp["scenarios"]["none"]["ranks"] = {
        str(straggler): {"min_step_time": 0.01, "slowdown": 4.0}}
    path.write_text(json.dumps(exp))
    md = write_report(tmp_path).markdown.read_text()
    assert "Held-out evaluation: worker 0 evaluates" in md
    said = "Worker 0, the evaluator, is also this scenario's straggler (4x slower"
    assert (said in md) == (straggler == 0)
