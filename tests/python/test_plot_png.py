"""tests/bench/plot_png.py, the standard-library PNG line-plot renderer used
by the benchmark scripts: the PNG it writes is decoded here by an independent
decoder (signature, chunk CRCs, IHDR, zlib, filter bytes), then checked for
size, background, series colours, dashes, marker positions and axes; bad
specs must fail cleanly on the command line (exit 2, a message, no
traceback)."""

import collections
import copy
import json
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import plot_png  # noqa: E402

SCRIPT = BENCH_DIR / "plot_png.py"
WHITE, BLACK = (255, 255, 255), (0, 0, 0)


# ---------------------------------------------------------------------------
# An independent PNG decoder (8-bit RGB, filter 0 only: what plot_png writes)
# ---------------------------------------------------------------------------

class Image:
    def __init__(self, width, height, rgb):
        self.width, self.height, self.rgb = width, height, rgb

    def pixel(self, x, y):
        i = (y * self.width + x) * 3
        return tuple(self.rgb[i:i + 3])

    def counts(self):
        """Counter of (r, g, b) -> number of pixels."""
        return collections.Counter(zip(self.rgb[0::3], self.rgb[1::3], self.rgb[2::3]))

    def count_in(self, colour, x0, y0, x1, y1):
        """Pixels of `colour` in the rectangle (inclusive corners)."""
        return sum(self.pixel(x, y) == colour
                   for y in range(y0, y1 + 1) for x in range(x0, x1 + 1))


def decode_png(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "bad PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        assert pos + 12 <= len(data), "truncated chunk header"
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert len(body) == length, f"truncated {kind} chunk"
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind} chunk"
        chunks.append((kind, body))
        pos += 12 + length
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND", kinds
    assert b"IDAT" in kinds
    width, height, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)
    assert width > 0 and height > 0
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = width * 3
    assert len(raw) == height * (stride + 1), "IDAT size does not match IHDR"
    rows = []
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        assert line[0] == 0, f"row {y}: filter type {line[0]}, expected 0"
        rows.append(line[1:])
    return Image(width, height, b"".join(rows))


# ---------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------

COLD = {"title": "Cold shuffled streams", "x_label": "trainers", "y_label": "MB/s per trainer",
        "series": [
            {"name": "shardcast layer 1 of 2, content",
             "points": [[1, 3100.5], [4, 1500], [8, 800]]},
            {"name": "fio reference", "points": [[1, 3300], [4, 3300], [8, 3300]], "dashed": True}]}
WARM = {"title": "Warm, gRPC messages", "x_label": "trainers", "y_label": "MB/s per trainer",
        "series": [{"name": "shm × 2, ≥ 1", "points": [[1, 9000], [2, 8000], [4, 5000]]},
                   {"name": "grpc", "points": [[1, 700], [2, 650], [4, 400]]}]}


def spec_of(*panels, title="shardcast, 2-core VM, 2026-11-25"):
    return {"title": title, "panels": [copy.deepcopy(p) for p in panels]}


def render(spec):
    return decode_png(plot_png.render(spec))


@pytest.fixture(scope="module")
def two_panels():
    return spec_of(COLD, WARM), render(spec_of(COLD, WARM))


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def test_size_grows_with_panels(two_panels):
    _, img2 = two_panels
    img1 = render(spec_of(COLD))
    assert img1.width >= 560 and img1.height >= 400
    assert img2.width >= img1.width + 560, (img1.width, img2.width)
    assert img2.height == img1.height


def test_background_white_at_corners(two_panels):
    _, img = two_panels
    for x, y in [(0, 0), (img.width - 1, 0), (0, img.height - 1),
                 (img.width - 1, img.height - 1)]:
        assert img.pixel(x, y) == WHITE, (x, y)


def test_each_series_has_its_own_colour_in_the_image(two_panels):
    spec, img = two_panels
    colours = plot_png.series_colours(spec)
    names = [s["name"] for p in spec["panels"] for s in p["series"]]
    assert set(colours) == set(names)
    assert len(set(colours.values())) == len(names), "two series share a colour"
    counts = img.counts()
    for name, colour in colours.items():
        # 3 markers of 7x7 at least, plus lines and the legend sample
        assert counts[tuple(colour)] > 150, (name, tuple(colour), counts[tuple(colour)])


def test_a_name_keeps_its_colour_across_panels():
    a = {"series": [{"name": "x", "points": [[1, 1]]}, {"name": "ref", "points": [[1, 2]]}]}
    b = {"series": [{"name": "ref", "points": [[1, 2]]}]}
    colours = plot_png.series_colours(spec_of(a, b))
    assert colours["x"] != colours["ref"]
    img = render(spec_of(a, b))
    g = plot_png.panel_geometry(spec_of(a, b), 1)
    assert img.pixel(*g.to_pixel(1, 2)) == tuple(colours["ref"])


def test_dashed_line_has_gaps():
    def panel(dashed):
        return {"series": [{"name": "s", "points": [[0, 0], [10, 10]], "dashed": dashed}]}

    solid = render(spec_of(panel(False)))
    dashed = render(spec_of(panel(True)))
    colour = tuple(plot_png.PALETTE[0])
    n_solid, n_dashed = solid.counts()[colour], dashed.counts()[colour]
    assert 0 < n_dashed < 0.85 * n_solid, (n_dashed, n_solid)
    # along the line, between the two markers, the dashed one has gaps
    g = plot_png.panel_geometry(spec_of(panel(True)))
    (x0, y0), (x1, y1) = g.to_pixel(0, 0), g.to_pixel(10, 10)
    samples = [(round(x0 + (x1 - x0) * t / 1000), round(y0 + (y1 - y0) * t / 1000))
               for t in range(100, 901)]

    def near(img, x, y):  # the colour within 1 px of (x, y)
        return img.count_in(colour, x - 1, y - 1, x + 1, y + 1) > 0

    assert all(near(solid, x, y) for x, y in samples)
    gaps = sum(not near(dashed, x, y) for x, y in samples)
    assert gaps >= 50, gaps


def test_marker_drawn_where_the_axis_mapping_says(two_panels):
    spec, img = two_panels
    g = plot_png.panel_geometry(spec, 0)
    colour = tuple(plot_png.series_colours(spec)["shardcast layer 1 of 2, content"])
    px, py = g.to_pixel(4, 1500)
    assert g.plot_left < px < g.plot_right and g.plot_top < py < g.plot_bottom
    # the whole marker square (7x7) around the point is the series colour
    assert img.count_in(colour, px - 2, py - 2, px + 2, py + 2) == 25
    # the mapping agrees with the drawn axes: y=0 is the frame's bottom row,
    # x=4 has a tick mark below it, x=1 < x=4 < x=8 from left to right
    x4, y0 = g.to_pixel(4, 0)
    assert y0 == g.plot_bottom
    assert img.pixel(x4, g.plot_bottom + 3) == BLACK
    assert img.pixel(x4 + 3, g.plot_bottom + 3) == WHITE
    assert g.to_pixel(1, 0)[0] < x4 < g.to_pixel(8, 0)[0]
    # independently of to_pixel: find the tick marks in the image (black runs
    # outside the frame) and interpolate between them
    x_ticks = [x for x in range(g.plot_left, g.plot_right + 1)
               if img.pixel(x, g.plot_bottom + 3) == BLACK]
    y_ticks = [y for y in range(g.plot_bottom, g.plot_top - 1, -1)
               if img.pixel(g.plot_left - 3, y) == BLACK]
    assert len(x_ticks) == 3, x_ticks           # x = 1, 4, 8
    assert len(y_ticks) == 5, y_ticks           # y = 0, 1000, ..., 4000
    c1, c4, c8 = x_ticks
    assert abs((c4 - c1) / (c8 - c1) - 3 / 7) < 0.01
    r1500 = y_ticks[0] + 1.5 * (y_ticks[1] - y_ticks[0])
    assert abs(r1500 - py) <= 1 and c4 == px
    assert img.count_in(colour, c4 - 2, round(r1500) - 2, c4 + 2, round(r1500) + 2) == 25
    # the second panel lies to the right of the first
    g2 = plot_png.panel_geometry(spec, 1)
    assert g2.plot_left > g.plot_right
    x, y = g2.to_pixel(2, 8000)
    assert img.pixel(x, y) == tuple(plot_png.series_colours(spec)["shm × 2, ≥ 1"])


def test_ticks_are_nice():
    lo, hi, ticks = plot_png.y_axis([3100.5, 1500, 800, 3300])
    assert (lo, hi) == (0, 4000)
    assert [label for _, label in ticks] == ["0", "1000", "2000", "3000", "4000"]
    for values in ([0.37], [12.5, 3], [7e6], [-3, 41]):
        lo, hi, ticks = plot_png.y_axis(values)
        assert lo <= min(values + [0]) and hi >= max(values)
        step = ticks[1][0] - ticks[0][0]
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)), (values, step)
        assert 3 <= len(ticks) <= 8, (values, ticks)
    # x: the distinct values when there are at most 10, else nice steps
    assert [t for t, _ in plot_png.x_axis([8, 1, 4, 4, 1])[2]] == [1, 4, 8]
    lo, hi, ticks = plot_png.x_axis(list(range(1, 40)))
    assert (lo, hi) == (1, 39)
    assert [label for _, label in ticks] == ["5", "10", "15", "20", "25", "30", "35"]


def test_font_covers_the_required_characters():
    box = plot_png.glyph_rows("\uffff")
    for ch in ("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
               " .,:;-+/()%x=_<>'\"×≥"):
        rows = plot_png.glyph_rows(ch)
        assert len(rows) in (7, 9) and all(0 <= r < 32 for r in rows), ch
        assert rows != box, ch
    assert any(box)


def test_titles_are_drawn(two_panels):
    spec, img = two_panels
    g = plot_png.panel_geometry(spec, 0)
    # black text pixels in the band above the first panel (overall title)
    assert img.count_in(BLACK, 0, 0, img.width - 1, g.cell_top - 1) > 100
    untitled = render(spec_of(COLD, WARM, title=""))
    assert untitled.height < img.height


def test_cli_writes_the_png(tmp_path):
    spec_path, out = tmp_path / "spec.json", tmp_path / "out.png"
    spec_path.write_text(json.dumps(spec_of(COLD)), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(spec_path), str(out)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == plot_png.render(spec_of(COLD))


def test_help():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    assert "SPEC.json" in proc.stdout and "OUT.png" in proc.stdout


def _bad(mutate):
    spec = spec_of(COLD)
    mutate(spec)
    return json.dumps(spec)


BAD_SPECS = [
    ("no panels key", json.dumps({"title": "t"}), "panels"),
    ("empty panels", json.dumps({"panels": []}), "panels"),
    ("missing series", _bad(lambda s: s["panels"][0].pop("series")), "series"),
    ("empty series", _bad(lambda s: s["panels"][0].update(series=[])), "series"),
    ("missing points", _bad(lambda s: s["panels"][0]["series"][1].pop("points")), "points"),
    ("empty points", _bad(lambda s: s["panels"][0]["series"][0].update(points=[])), "points"),
    ("string y", _bad(lambda s: s["panels"][0]["series"][0]["points"][1].__setitem__(1, "fast")),
     "points[1][1]"),
    ("short point", _bad(lambda s: s["panels"][0]["series"][0]["points"].append([3])), "points[3]"),
    ("missing name", _bad(lambda s: s["panels"][0]["series"][0].pop("name")), "name"),
    ("misspelt key", _bad(lambda s: s["panels"][0]["series"][1].update(dash=True)), "dash"),
    ("not json", "{panels: oops", "JSON"),
    ("not an object", "[1, 2]", "object"),
]


@pytest.mark.parametrize("why,text,named", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_exits_2_with_a_message(tmp_path, why, text, named):
    spec_path, out = tmp_path / "spec.json", tmp_path / "out.png"
    spec_path.write_text(text, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(spec_path), str(out)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, (why, proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert named in proc.stderr, (why, proc.stderr)
    assert not out.exists()


def test_missing_spec_file_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope.json"),
                           str(tmp_path / "out.png")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "nope.json" in proc.stderr and "Traceback" not in proc.stderr


def test_render_raises_spec_error_for_nan():
    spec = spec_of(COLD)
    spec["panels"][0]["series"][0]["points"][0][1] = float("nan")
    with pytest.raises(plot_png.SpecError, match=r"points\[0\]\[1\]"):
        plot_png.render(spec)
