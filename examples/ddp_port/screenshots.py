"""Regenerate the report screenshots of docs/experiments.md from a real run of this grid.

From the repository root, with Chromium installed (``apt-get install chromium``)::

    python examples/ddp_port/screenshots.py              # runs the grid into runs/ddp-port
    python examples/ddp_port/screenshots.py --reuse      # screenshots an existing run only

It runs ``paramserver experiment --spec examples/ddp_port/grid.toml`` and takes two
1,400 px wide screenshots of its report.html in headless Chromium: the top of the page
(header, outcome and dynamics tables) as docs/img/ddp-port-report.png, and the plots from
"the work spent" on as docs/img/ddp-port-plots.png. The PNGs are reduced to 256 colours.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
#: run on load: drop what comes before the plot of the work spent, so it opens the page
PLOTS_FIRST = """<script>
let el = document.querySelector("img[alt*='gradients computed']");
while (el.parentElement !== document.body) el = el.parentElement;
while (el.previousElementSibling) el.previousElementSibling.remove();
</script>"""


def screenshot(chromium: str, page: Path, png: Path, profile: Path) -> None:
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--user-data-dir={profile}",
                    "--window-size=1400,1800", f"--screenshot={png}", page.as_uri()],
                   check=True, timeout=120, capture_output=True)
    Image.open(png).convert("RGB").quantize(colors=256).save(png, optimize=True)
    print(f"{png.relative_to(ROOT)}: {png.stat().st_size // 1024} KiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "ddp-port")
    ap.add_argument("--reuse", action="store_true", help="do not run the grid: use --out's")
    args = ap.parse_args()
    chromium = next(filter(None, map(shutil.which,
                                     ("chromium", "chromium-browser", "google-chrome"))), None)
    if chromium is None:
        sys.exit("no chromium on PATH (apt-get install chromium)")
    if not args.reuse:  # "python" in the spec's command is this interpreter, as in a venv
        env = {**os.environ,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        subprocess.run([sys.executable, "-m", "paramserver.cli", "experiment", "--spec",
                        "examples/ddp_port/grid.toml", "--out", str(args.out),
                        "--overwrite", "--quiet"], cwd=ROOT, env=env, check=True)
    report = args.out / "report.html"
    with tempfile.TemporaryDirectory() as tmp:
        plots = Path(tmp) / "plots.html"
        plots.write_text(report.read_text().replace("</body>", PLOTS_FIRST + "</body>"))
        screenshot(chromium, report, IMG / "ddp-port-report.png", Path(tmp) / "profile")
        screenshot(chromium, plots, IMG / "ddp-port-plots.png", Path(tmp) / "profile")


if __name__ == "__main__":
    main()
