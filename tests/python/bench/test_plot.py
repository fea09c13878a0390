"""tests/bench/plot.py, the benchmark plots drawn by matplotlib: the PNG it
writes is read back independently (signature, then decoded by PIL or
matplotlib.image) and checked for its size and for being a drawing, not a
blank; tests/bench/matrix_report.py draws one from a tiny fake run."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="python3-matplotlib (deploy/install-deps.sh)")

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import plot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def spec():
    """Two panels as matrix_report.py builds them, a series name shared."""
    return {
        "title": "shardcast vs same-run references (run_matrix.sh)",
        "panels": [
            {"title": "Cold shuffled streams", "x_label": "trainers",
             "y_label": "MB/s per trainer",
             "series": [
                 {"name": "1 layer of 2, content", "points": [[1, 1450.5], [4, 1210], [8, 900]]},
                 {"name": "all layers of 2, content", "points": [[1, 1300], [4, 1100], [8, 700]]},
                 {"name": "fio sequential (reference)", "points": [[1, 1500], [4, 1500], [8, 1500]],
                  "dashed": True}]},
            {"title": "Warm streams", "x_label": "trainers", "y_label": "MB/s per trainer",
             "series": [
                 {"name": "gRPC messages", "points": [[1, 2600], [4, 1500], [8, 800]]},
                 {"name": "bare gRPC loop (reference)", "points": [[1, 2700], [4, 1600], [8, 850]],
                  "dashed": True},
                 {"name": "shm × 2, ≥ 1", "points": [[1, 9000], [4, 7000], [8, 4000]]}]},
        ],
    }


def read_png(path):
    """(height, width, distinct RGB colours) of a PNG, decoded by PIL where
    installed, else by matplotlib.image."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    try:
        from PIL import Image
        with Image.open(path) as im:
            pixels = np.asarray(im.convert("RGB"))
    except ImportError:
        import matplotlib.image
        pixels = (matplotlib.image.imread(path)[:, :, :3] * 255).round().astype(np.uint8)
    h, w = pixels.shape[:2]
    return h, w, np.unique(pixels.reshape(-1, 3), axis=0)


def test_two_panels_side_by_side(tmp_path):
    out = tmp_path / "plot.png"
    plot.write(spec(), out)
    h, w, colours = read_png(out)
    assert (w, h) == (2 * plot.PANEL_SIZE[0] * plot.DPI, plot.PANEL_SIZE[1] * plot.DPI)
    assert len(colours) > 10, "a blank or near-blank image"
    # The series' colours are drawn (matplotlib's default cycle: blue, orange, ...).
    for hex_colour in ("#1f77b4", "#ff7f0e", "#2ca02c"):
        rgb = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
        assert (colours == rgb).all(axis=1).any(), f"no pixel of {hex_colour}"


def test_one_panel_and_command_line(tmp_path):
    one = {"panels": [spec()["panels"][1]]}
    (tmp_path / "spec.json").write_text(json.dumps(one), encoding="utf-8")
    r = subprocess.run([sys.executable, str(BENCH_DIR / "plot.py"), str(tmp_path / "spec.json"),
                        str(tmp_path / "one.png")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    h, w, colours = read_png(tmp_path / "one.png")
    assert (w, h) == (plot.PANEL_SIZE[0] * plot.DPI, plot.PANEL_SIZE[1] * plot.DPI)
    assert len(colours) > 10


def test_matrix_report_draws_its_plot(tmp_path):
    """A fake run_matrix.sh run: cold and warm stream results only (no
    query step), as matrix_report.py reads them."""
    out = tmp_path / "out"
    out.mkdir()

    def put(name, rates, **extra):
        (out / name).write_text(json.dumps(
            {"clients": [{"bytes_per_second": x} for x in rates], **extra}))

    for n in (1, 4, 8):
        put(f"cold-l1of2-{n}.json", [1.2e9 / n] * n, fio={"mean": 1.3e9 / n},
            selected_bytes_per_epoch=5e9, epochs=1, proc_io_read_bytes=5.01e9)
        for r in (1, 2, 3):
            put(f"warm-grpc-{n}-{r}.json", [2.5e9 / n] * n)
            put(f"bare-{n}-{r}.json", [2.7e9 / n] * n)
        put(f"warm-shm-{n}.json", [9e9 / n] * n)
    png, figures = tmp_path / "matrix.png", tmp_path / "matrix.json"
    r = subprocess.run([sys.executable, str(BENCH_DIR / "matrix_report.py"), "--out", str(out),
                        "--query", str(tmp_path / "no-query"), "--json", str(figures),
                        "--png", str(png)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "plot not written" not in r.stderr, r.stderr
    assert f"plot: {png}" in r.stdout
    assert len(json.loads(figures.read_text())["cold"]) == 3
    h, w, colours = read_png(png)
    assert (w, h) == (2 * plot.PANEL_SIZE[0] * plot.DPI, plot.PANEL_SIZE[1] * plot.DPI)
    assert len(colours) > 10
