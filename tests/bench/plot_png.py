#!/usr/bin/python3
"""Line plots as PNG files, for the benchmark scripts (throughput against the
number of trainers, one panel per scenario).

Why not matplotlib: the benchmark machines run the distribution's
/usr/bin/python3 (Debian bookworm), where neither matplotlib nor PIL is
installed, and the benchmarks must not need anything beyond what the daemon's
tests already need. So this module uses the Python standard library only: a
tiny built-in 5x7 bitmap font, Bresenham lines, and a PNG encoder
(zlib + struct). It draws plain, legible plots; it is not a general plotting
library.

Usage:
    /usr/bin/python3 tests/bench/plot_png.py SPEC.json OUT.png

    import plot_png
    png_bytes = plot_png.render(spec)
    plot_png.write(spec, "out.png")

SPEC (JSON):
    {"title": "overall title (optional)",
     "panels": [                              # drawn side by side, left to right
       {"title": "...", "x_label": "...", "y_label": "...",   # all optional
        "series": [
          {"name": "...", "points": [[x, y], ...], "dashed": false}, ...]}]}

Required keys: "panels" (non-empty list), each panel's "series" (non-empty
list), each series' "name" (string) and "points" (non-empty list of [x, y]
finite numbers). Unknown keys are rejected, so a misspelt "dashed" is not
silently ignored. A series name keeps the same colour in every panel.

Axes: y starts at 0 (lower if a value is negative) and ends at a "nice" tick
(steps of 1, 2 or 5 x 10^k); x covers the points' x range, with ticks at the
distinct x values when there are at most 10 of them, else at nice steps.
"""

import argparse
import json
import math
import struct
import sys
import zlib

# --------------------------------------------------------------------------
# Colours and sizes
# --------------------------------------------------------------------------

WHITE = bytes((255, 255, 255))
BLACK = bytes((0, 0, 0))
GRID = bytes((228, 228, 228))
LEGEND_BORDER = bytes((150, 150, 150))

# Series colours, in order of first appearance of a series name (Tableau 10
# without its grey, which would be confused with the grid).
PALETTE = [bytes(c) for c in (
    (31, 119, 180),   # blue
    (255, 127, 14),   # orange
    (44, 160, 44),    # green
    (214, 39, 40),    # red
    (148, 103, 189),  # purple
    (140, 86, 75),    # brown
    (227, 119, 194),  # pink
    (23, 190, 207),   # cyan
)]

PLOT_W, PLOT_H = 560, 400   # the data area of one panel, in pixels
MARGIN = 20                 # around the whole figure
PANEL_GAP = 30              # between two panels
X_PAD = 24                  # keeps the first and last x off the frame
TICK_LEN = 5
MARKER = 7                  # side of the square point markers (odd: centred)
LINE_W = 2                  # series line thickness
DASH_ON, DASH_OFF = 10, 6   # dashed series pattern, in pixels along the line

# Text scales (the font is 5x7 pixels; a scale-2 glyph is 10x14).
TITLE_SCALE, PANEL_TITLE_SCALE, LABEL_SCALE = 3, 2, 2
LEGEND_ROW = 20             # legend line height at scale 2
LEGEND_PAD = 8
LEGEND_SAMPLE = 28          # length of the line sample in front of a name

# --------------------------------------------------------------------------
# Font: each glyph is 7 rows, top to bottom, each row a 5-bit hex number
# whose bit 4 (0x10) is the leftmost column; g j p q y have 2 more rows, their
# descenders, drawn below the line. Shapes follow the classic HD44780 LCD
# character ROM.
# --------------------------------------------------------------------------

GLYPH_W, GLYPH_H = 5, 7
_BOX = "1F 11 11 11 11 11 1F"  # drawn for any character not in the table
_GLYPHS = {
    " ": "00 00 00 00 00 00 00", "!": "04 04 04 04 04 00 04", '"': "0A 0A 0A 00 00 00 00",
    "#": "0A 0A 1F 0A 1F 0A 0A", "$": "04 0F 14 0E 05 1E 04", "%": "18 19 02 04 08 13 03",
    "&": "0C 12 14 08 15 12 0D", "'": "0C 04 08 00 00 00 00", "(": "02 04 08 08 08 04 02",
    ")": "08 04 02 02 02 04 08", "*": "00 04 15 0E 15 04 00", "+": "00 04 04 1F 04 04 00",
    ",": "00 00 00 00 0C 04 08", "-": "00 00 00 1F 00 00 00", ".": "00 00 00 00 00 0C 0C",
    "/": "00 01 02 04 08 10 00", ":": "00 0C 0C 00 0C 0C 00", ";": "00 0C 0C 00 0C 04 08",
    "<": "02 04 08 10 08 04 02", "=": "00 00 1F 00 1F 00 00", ">": "08 04 02 01 02 04 08",
    "?": "0E 11 01 02 04 00 04", "@": "0E 11 01 0D 15 15 0E", "[": "0E 08 08 08 08 08 0E",
    "\\": "00 10 08 04 02 01 00", "]": "0E 02 02 02 02 02 0E", "^": "04 0A 11 00 00 00 00",
    "_": "00 00 00 00 00 00 1F", "`": "08 04 02 00 00 00 00", "{": "02 04 04 08 04 04 02",
    "|": "04 04 04 04 04 04 04", "}": "08 04 04 02 04 04 08", "~": "00 00 08 15 02 00 00",
    "×": "00 11 0A 04 0A 11 00", "≥": "08 04 02 04 08 00 1F", "≤": "02 04 08 04 02 00 1F",
    "µ": "00 00 11 11 13 1D 10", "–": "00 00 00 1F 00 00 00", "—": "00 00 00 1F 00 00 00",
    "0": "0E 11 13 15 19 11 0E", "1": "04 0C 04 04 04 04 0E", "2": "0E 11 01 02 04 08 1F",
    "3": "1F 02 04 02 01 11 0E", "4": "02 06 0A 12 1F 02 02", "5": "1F 10 1E 01 01 11 0E",
    "6": "06 08 10 1E 11 11 0E", "7": "1F 01 02 04 08 08 08", "8": "0E 11 11 0E 11 11 0E",
    "9": "0E 11 11 0F 01 02 0C",
    "A": "0E 11 11 11 1F 11 11", "B": "1E 11 11 1E 11 11 1E", "C": "0E 11 10 10 10 11 0E",
    "D": "1C 12 11 11 11 12 1C", "E": "1F 10 10 1E 10 10 1F", "F": "1F 10 10 1E 10 10 10",
    "G": "0E 11 10 17 11 11 0F", "H": "11 11 11 1F 11 11 11", "I": "0E 04 04 04 04 04 0E",
    "J": "07 02 02 02 02 12 0C", "K": "11 12 14 18 14 12 11", "L": "10 10 10 10 10 10 1F",
    "M": "11 1B 15 15 11 11 11", "N": "11 11 19 15 13 11 11", "O": "0E 11 11 11 11 11 0E",
    "P": "1E 11 11 1E 10 10 10", "Q": "0E 11 11 11 15 12 0D", "R": "1E 11 11 1E 14 12 11",
    "S": "0F 10 10 0E 01 01 1E", "T": "1F 04 04 04 04 04 04", "U": "11 11 11 11 11 11 0E",
    "V": "11 11 11 11 11 0A 04", "W": "11 11 11 15 15 15 0A", "X": "11 11 0A 04 0A 11 11",
    "Y": "11 11 11 0A 04 04 04", "Z": "1F 01 02 04 08 10 1F",
    "a": "00 00 0E 01 0F 11 0F", "b": "10 10 16 19 11 11 1E", "c": "00 00 0E 10 10 11 0E",
    "d": "01 01 0D 13 11 11 0F", "e": "00 00 0E 11 1F 10 0E", "f": "06 09 08 1C 08 08 08",
    "g": "00 00 0F 11 11 11 0F 01 0E", "h": "10 10 16 19 11 11 11", "i": "04 00 0C 04 04 04 0E",
    "j": "02 00 06 02 02 02 02 12 0C", "k": "10 10 12 14 18 14 12", "l": "0C 04 04 04 04 04 0E",
    "m": "00 00 1A 15 15 11 11", "n": "00 00 16 19 11 11 11", "o": "00 00 0E 11 11 11 0E",
    "p": "00 00 1E 11 11 11 1E 10 10", "q": "00 00 0F 11 11 11 0F 01 01",
    "r": "00 00 16 19 10 10 10", "s": "00 00 0E 10 0E 01 1E", "t": "08 08 1C 08 08 09 06",
    "u": "00 00 11 11 11 13 0D", "v": "00 00 11 11 11 0A 04", "w": "00 00 11 11 15 15 0A",
    "x": "00 00 11 0A 04 0A 11", "y": "00 00 11 11 11 11 0F 01 0E", "z": "00 00 1F 02 04 08 1F",
}


def glyph_rows(ch):
    """The row bitmasks of character `ch`, top to bottom: 7 rows, or 9 for a
    letter with a descender (a box for unknown characters)."""
    return [int(h, 16) for h in _GLYPHS.get(ch, _BOX).split()]


def text_width(text, scale=1):
    """Width in pixels of `text` drawn at `scale` (1 px gap between glyphs)."""
    return max(0, len(text) * (GLYPH_W + 1) * scale - scale)


def fit_scale(text, room, scale):
    """The largest scale <= `scale` (and >= 1) at which `text` fits in `room`
    pixels of width."""
    while scale > 1 and text_width(text, scale) > room:
        scale -= 1
    return scale


def text_height(scale=1):
    """Height in pixels of one line of text at `scale` (descenders, 2 rows
    more, are left out: layouts leave room for them below the line)."""
    return GLYPH_H * scale


# --------------------------------------------------------------------------
# Canvas: an RGB pixel buffer with the few drawing operations a plot needs
# --------------------------------------------------------------------------

class Canvas:
    """A width x height RGB image, 3 bytes per pixel, row-major; drawing
    outside it is clipped silently."""

    def __init__(self, width, height, background=WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(background * (width * height))

    def set(self, x, y, colour):
        """Paints one pixel."""
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = colour

    def get(self, x, y):
        """The colour of one pixel, as 3 bytes."""
        i = (y * self.width + x) * 3
        return bytes(self.pixels[i:i + 3])

    def fill_rect(self, x0, y0, x1, y1, colour):
        """Fills the rectangle with corners (x0, y0) and (x1, y1), inclusive."""
        x0, x1 = max(0, min(x0, x1)), min(self.width - 1, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height - 1, max(y0, y1))
        if x0 > x1 or y0 > y1:
            return
        run = colour * (x1 - x0 + 1)
        for y in range(y0, y1 + 1):
            i = (y * self.width + x0) * 3
            self.pixels[i:i + len(run)] = run

    def outline_rect(self, x0, y0, x1, y1, colour):
        """Draws a 1 px rectangle border."""
        self.fill_rect(x0, y0, x1, y0, colour)
        self.fill_rect(x0, y1, x1, y1, colour)
        self.fill_rect(x0, y0, x0, y1, colour)
        self.fill_rect(x1, y0, x1, y1, colour)

    def text(self, x, y, text, colour=BLACK, scale=1, bold=False):
        """Draws `text` with its top-left corner at (x, y)."""
        for ch in text:
            for row, bits in enumerate(glyph_rows(ch)):
                for col in range(GLYPH_W):
                    if bits & (0x10 >> col):
                        px, py = x + col * scale, y + row * scale
                        self.fill_rect(px, py, px + scale - 1 + bold, py + scale - 1, colour)
            x += (GLYPH_W + 1) * scale

    def line(self, x0, y0, x1, y1, colour, width=LINE_W, dash=None, phase=0.0):
        """Draws a straight line `width` px thick (Bresenham, square pen).

        dash=(on, off) draws a dashed line; `phase` is how far along the
        pattern the line starts, and the phase at its end is returned, so a
        polyline's dashes continue smoothly from one segment to the next."""
        dx, dy = abs(x1 - x0), abs(y1 - y0)
        steps = max(dx, dy)
        step_len = math.hypot(dx, dy) / steps if steps else 0.0
        sx, sy = (1 if x1 > x0 else -1), (1 if y1 > y0 else -1)
        err, x, y = dx - dy, x0, y0
        off = width // 2
        for i in range(steps + 1):
            along = phase + i * step_len
            if dash is None or along % (dash[0] + dash[1]) < dash[0]:
                self.fill_rect(x - off, y - off, x - off + width - 1, y - off + width - 1, colour)
            e2 = 2 * err
            if e2 > -dy:
                err, x = err - dy, x + sx
            if e2 < dx:
                err, y = err + dx, y + sy
        return phase + steps * step_len

    def marker(self, x, y, colour, size=MARKER):
        """A filled square of side `size` centred on (x, y)."""
        h = size // 2
        self.fill_rect(x - h, y - h, x + h, y + h, colour)


# --------------------------------------------------------------------------
# PNG encoding
# --------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_chunk(kind, data):
    """One PNG chunk: length, type, data, CRC-32 of type + data."""
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(width, height, rgb):
    """A PNG file (8-bit RGB, no interlace, filter 0 on every row) of the
    row-major RGB bytes `rgb`."""
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (PNG_SIGNATURE + png_chunk(b"IHDR", ihdr)
            + png_chunk(b"IDAT", zlib.compress(raw, 9)) + png_chunk(b"IEND", b""))


# --------------------------------------------------------------------------
# Spec validation
# --------------------------------------------------------------------------

class SpecError(ValueError):
    """The plot spec is malformed; the message names the offending item."""


_SPEC_KEYS = {"title", "panels"}
_PANEL_KEYS = {"title", "x_label", "y_label", "series"}
_SERIES_KEYS = {"name", "points", "dashed"}


def _check_keys(obj, where, known, required):
    if not isinstance(obj, dict):
        raise SpecError(f"{where}: expected an object, got {type(obj).__name__}")
    for key in required:
        if key not in obj:
            raise SpecError(f"{where}: missing key '{key}'")
    unknown = sorted(set(obj) - known)
    if unknown:
        raise SpecError(f"{where}: unknown key '{unknown[0]}' (known: {', '.join(sorted(known))})")


def _text(obj, key, where):
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise SpecError(f"{where}.{key}: expected a string, got {json.dumps(value)}")
    return value


def _number(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: expected a number, got {json.dumps(value)}")
    if not math.isfinite(value):
        raise SpecError(f"{where}: expected a finite number, got {value}")
    return float(value)


def _points(value, where):
    if not isinstance(value, (list, tuple)) or not value:
        raise SpecError(f"{where}: expected a non-empty list of [x, y] points")
    points = []
    for i, p in enumerate(value):
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise SpecError(f"{where}[{i}]: expected [x, y], got {json.dumps(p)}")
        points.append((_number(p[0], f"{where}[{i}][0] (x)"),
                       _number(p[1], f"{where}[{i}][1] (y)")))
    return points


def _series(s, where):
    _check_keys(s, where, _SERIES_KEYS, ("name", "points"))
    dashed = s.get("dashed", False)
    if not isinstance(dashed, bool):
        raise SpecError(f"{where}.dashed: expected true or false, got {json.dumps(dashed)}")
    return {"name": _text(s, "name", where), "dashed": dashed,
            "points": _points(s["points"], f"{where}.points")}


def _panel(p, where):
    _check_keys(p, where, _PANEL_KEYS, ("series",))
    if not isinstance(p["series"], list) or not p["series"]:
        raise SpecError(f"{where}.series: expected a non-empty list of series")
    series, names = [], set()
    for i, s in enumerate(p["series"]):
        s = _series(s, f"{where}.series[{i}]")
        if s["name"] in names:
            raise SpecError(f"{where}.series[{i}]: duplicate series name {json.dumps(s['name'])}")
        names.add(s["name"])
        series.append(s)
    return {"title": _text(p, "title", where), "x_label": _text(p, "x_label", where),
            "y_label": _text(p, "y_label", where), "series": series}


def validate(spec):
    """Checks `spec` and returns it normalised (defaults filled in, numbers as
    floats, points as tuples). Raises SpecError naming what is wrong."""
    _check_keys(spec, "spec", _SPEC_KEYS, ("panels",))
    if not isinstance(spec["panels"], list) or not spec["panels"]:
        raise SpecError("spec.panels: expected a non-empty list of panels")
    return {"title": _text(spec, "title", "spec"),
            "panels": [_panel(p, f"panels[{i}]") for i, p in enumerate(spec["panels"])]}


# --------------------------------------------------------------------------
# Ticks and layout
# --------------------------------------------------------------------------

def nice_step(span, target=6):
    """The step of the form 1, 2 or 5 x 10^k that cuts `span` into about
    `target` intervals (at most `target`, rounding up)."""
    raw = span / target
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5):
        if m * mag >= raw * (1 - 1e-9):
            return m * mag
    return 10 * mag


def format_number(value, step=None):
    """A tick label: integers without a decimal point, else as many decimals
    as `step` needs (or up to 6 significant digits without a step)."""
    if step is not None and step < 1:
        return f"{value:.{max(0, -math.floor(math.log10(step) + 1e-9))}f}"
    if abs(value - round(value)) < 1e-9 * max(1.0, abs(value)) and abs(value) < 1e15:
        return str(int(round(value)))
    return f"{value:.6g}"


def y_axis(values):
    """(lo, hi, ticks) for the y axis: from 0 (or a nice value below the
    smallest negative y) to the first nice tick at or above the largest y."""
    lo, hi = min(0.0, min(values)), max(0.0, max(values))
    if hi == lo:
        hi = lo + 1.0
    step = nice_step(hi - lo)
    lo_i, hi_i = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [(i * step, format_number(i * step, step)) for i in range(lo_i, hi_i + 1)]
    return lo_i * step, hi_i * step, ticks


def x_axis(values):
    """(lo, hi, ticks) for the x axis: the points' x range, ticks at the
    distinct x values when there are at most 10, else at nice steps."""
    distinct = sorted(set(values))
    lo, hi = distinct[0], distinct[-1]
    if lo == hi:
        lo, hi = lo - 1.0, hi + 1.0
    if len(distinct) <= 10:
        return lo, hi, [(x, format_number(x)) for x in distinct]
    step = nice_step(hi - lo, 8)
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return lo, hi, [(i * step, format_number(i * step, step)) for i in range(first, last + 1)]


class PanelGeometry:
    """Where one panel lies in the image and how it maps data to pixels.

    plot_left/plot_top/plot_right/plot_bottom bound the data area, inclusive;
    the frame is drawn on those rows and columns."""

    def __init__(self, panel, cell_left, cell_top, y_label_width):
        xs = [x for s in panel["series"] for x, _ in s["points"]]
        ys = [y for s in panel["series"] for _, y in s["points"]]
        self.x_lo, self.x_hi, self.x_ticks = x_axis(xs)
        self.y_lo, self.y_hi, self.y_ticks = y_axis(ys)
        self.cell_left, self.cell_top = cell_left, cell_top
        self.plot_left = cell_left + y_label_width
        self.plot_top = cell_top + panel_header_height()
        self.plot_right = self.plot_left + PLOT_W - 1
        self.plot_bottom = self.plot_top + PLOT_H - 1

    def to_pixel(self, x, y):
        """The pixel (column, row) where the data point (x, y) is drawn."""
        fx = (x - self.x_lo) / (self.x_hi - self.x_lo)
        fy = (y - self.y_lo) / (self.y_hi - self.y_lo)
        px = self.plot_left + X_PAD + fx * (PLOT_W - 1 - 2 * X_PAD)
        py = self.plot_bottom - fy * (PLOT_H - 1)
        return int(round(px)), int(round(py))


def panel_header_height():
    """Pixels from a panel's top to its data area: title, then y label."""
    return text_height(PANEL_TITLE_SCALE) + 10 + text_height(LABEL_SCALE) + 14


def legend_scale(panel):
    """Scale 2 for legend names when the longest fits in the data area's
    width, else 1."""
    longest = max(len(s["name"]) for s in panel["series"])
    room = PLOT_W - 2 * LEGEND_PAD - LEGEND_SAMPLE - 8
    return LABEL_SCALE if text_width("x" * longest, LABEL_SCALE) <= room else 1


def legend_height(panel):
    """Height of a panel's legend box."""
    row = LEGEND_ROW * legend_scale(panel) // LABEL_SCALE
    return 2 * LEGEND_PAD + len(panel["series"]) * row - (row - text_height(legend_scale(panel)))


def below_plot_height():
    """Pixels from the data area's bottom to the legend: tick labels, x label."""
    return 10 + text_height(LABEL_SCALE) + 10 + text_height(LABEL_SCALE) + 14


class Figure:
    """The whole image's layout: its size, the title's scale, and one
    PanelGeometry per panel. `spec` is the validated spec."""

    def __init__(self, spec):
        self.spec = spec = validate(spec)
        probes = [PanelGeometry(p, 0, 0, 0) for p in spec["panels"]]
        label_w = max(text_width(label, LABEL_SCALE) for g in probes for _, label in g.y_ticks)
        left = label_w + TICK_LEN + 8
        cell_w = left + PLOT_W + 24  # right: room for the last x tick label
        self.width = 2 * MARGIN + len(probes) * cell_w + (len(probes) - 1) * PANEL_GAP
        self.title_scale = fit_scale(spec["title"], self.width - 2 * MARGIN, TITLE_SCALE)
        top = MARGIN + (text_height(self.title_scale) + 16 if spec["title"] else 0)
        self.panels = [PanelGeometry(p, MARGIN + i * (cell_w + PANEL_GAP), top, left)
                       for i, p in enumerate(spec["panels"])]
        legend_h = max(legend_height(p) for p in spec["panels"])
        self.height = top + panel_header_height() + PLOT_H + below_plot_height() + legend_h + MARGIN


def layout(spec):
    """Validates `spec` and returns its Figure (sizes and per-panel mapping)."""
    return Figure(spec)


def panel_geometry(spec, index=0):
    """The PanelGeometry of panel `index` of `spec`: use its to_pixel(x, y)
    to find where a data point is drawn."""
    return layout(spec).panels[index]


def series_colours(spec):
    """{series name: colour}: palette colours in order of first appearance
    of each name across all panels (cycling after len(PALETTE) names)."""
    colours = {}
    for panel in validate(spec)["panels"]:
        for s in panel["series"]:
            colours.setdefault(s["name"], PALETTE[len(colours) % len(PALETTE)])
    return colours


# --------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------

def draw_axes(canvas, g):
    """Grid lines, frame, ticks and tick labels of one panel."""
    s = LABEL_SCALE
    for y, label in g.y_ticks:
        _, py = g.to_pixel(g.x_lo, y)
        canvas.fill_rect(g.plot_left, py, g.plot_right, py, GRID)
        canvas.fill_rect(g.plot_left - TICK_LEN, py, g.plot_left - 1, py, BLACK)
        canvas.text(g.plot_left - TICK_LEN - 4 - text_width(label, s), py - text_height(s) // 2,
                    label, scale=s)
    last_right = -10 ** 9
    for x, label in g.x_ticks:
        px, _ = g.to_pixel(x, g.y_lo)
        canvas.fill_rect(px, g.plot_top, px, g.plot_bottom, GRID)
        canvas.fill_rect(px, g.plot_bottom + 1, px, g.plot_bottom + TICK_LEN, BLACK)
        left = px - text_width(label, s) // 2
        if left > last_right + 6:  # skip labels that would overlap the previous one
            canvas.text(left, g.plot_bottom + TICK_LEN + 5, label, scale=s)
            last_right = left + text_width(label, s)
    canvas.outline_rect(g.plot_left, g.plot_top, g.plot_right, g.plot_bottom, BLACK)


def draw_labels(canvas, g, panel):
    """Panel title (centred above), y label (above the y axis), x label."""
    centre = (g.plot_left + g.plot_right) // 2
    room = g.plot_right - g.cell_left + 1
    t = panel["title"]
    s = fit_scale(t, room, PANEL_TITLE_SCALE)
    canvas.text(max(g.cell_left, centre - text_width(t, s) // 2), g.cell_top, t, scale=s,
                bold=True)
    y_label = panel["y_label"]
    s = fit_scale(y_label, room, LABEL_SCALE)
    canvas.text(g.cell_left, g.plot_top - 14 - text_height(s), y_label, scale=s)
    x_label = panel["x_label"]
    s = fit_scale(x_label, PLOT_W, LABEL_SCALE)
    canvas.text(centre - text_width(x_label, s) // 2,
                g.plot_bottom + 10 + text_height(LABEL_SCALE) + 10, x_label, scale=s)


def draw_series(canvas, g, series, colour):
    """One series: its polyline (solid or dashed) and its point markers."""
    pixels = [g.to_pixel(x, y) for x, y in sorted(series["points"])]
    dash = (DASH_ON, DASH_OFF) if series["dashed"] else None
    phase = 0.0
    for (x0, y0), (x1, y1) in zip(pixels, pixels[1:]):
        phase = canvas.line(x0, y0, x1, y1, colour, dash=dash, phase=phase)
    for px, py in pixels:
        canvas.marker(px, py, colour)


def draw_legend(canvas, g, panel, colours):
    """A bordered box below the x label: a line sample and the name of each
    series (below the axes so that it never hides data)."""
    scale = legend_scale(panel)
    row = LEGEND_ROW * scale // LABEL_SCALE
    names = [s["name"] for s in panel["series"]]
    width = 2 * LEGEND_PAD + LEGEND_SAMPLE + 8 + max(text_width(n, scale) for n in names)
    x0, y0 = g.plot_left, g.plot_bottom + below_plot_height()
    canvas.outline_rect(x0, y0, x0 + width - 1, y0 + legend_height(panel) - 1, LEGEND_BORDER)
    for i, s in enumerate(panel["series"]):
        ty = y0 + LEGEND_PAD + i * row
        cy = ty + text_height(scale) // 2
        lx = x0 + LEGEND_PAD
        dash = (DASH_ON, DASH_OFF) if s["dashed"] else None
        canvas.line(lx, cy, lx + LEGEND_SAMPLE - 1, cy, colours[s["name"]], dash=dash)
        canvas.marker(lx + LEGEND_SAMPLE // 2, cy, colours[s["name"]])
        canvas.text(lx + LEGEND_SAMPLE + 8, ty, s["name"], scale=scale)


def render(spec):
    """The PNG file (bytes) of the plot described by `spec` (see the module
    docstring). Raises SpecError if the spec is malformed."""
    fig = layout(spec)
    colours = series_colours(fig.spec)
    canvas = Canvas(fig.width, fig.height)
    title = fig.spec["title"]
    canvas.text((fig.width - text_width(title, fig.title_scale)) // 2, MARGIN, title,
                scale=fig.title_scale, bold=True)
    for panel, g in zip(fig.spec["panels"], fig.panels):
        draw_axes(canvas, g)
        draw_labels(canvas, g, panel)
        for s in panel["series"]:
            draw_series(canvas, g, s, colours[s["name"]])
        draw_legend(canvas, g, panel, colours)
    return encode_png(canvas.width, canvas.height, canvas.pixels)


def write(spec, path):
    """Renders `spec` and writes the PNG to `path`."""
    data = render(spec)
    with open(path, "wb") as f:
        f.write(data)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def main(argv=None):
    """CLI entry point; returns the exit status (2 for bad input)."""
    parser = argparse.ArgumentParser(
        description="Render line plots (e.g. throughput against trainers) from a JSON spec "
                    "to a PNG file, using the Python standard library only.",
        epilog='SPEC format: {"title": "...", "panels": [{"title": "...", "x_label": "...", '
               '"y_label": "...", "series": [{"name": "...", "points": [[x, y], ...], '
               '"dashed": false}]}]}. Panels are drawn side by side; y starts at 0. '
               "Bad input exits with status 2.")
    parser.add_argument("spec", metavar="SPEC.json", help="the plot description (JSON)")
    parser.add_argument("out", metavar="OUT.png", help="the PNG file to write")
    args = parser.parse_args(argv)
    try:
        with open(args.spec, encoding="utf-8") as f:
            spec = json.load(f)
    except OSError as e:
        print(f"plot_png: cannot read {args.spec}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (ValueError, UnicodeDecodeError) as e:
        print(f"plot_png: {args.spec} is not valid JSON: {e}", file=sys.stderr)
        return 2
    try:
        data = render(spec)
    except SpecError as e:
        print(f"plot_png: {args.spec}: {e}", file=sys.stderr)
        return 2
    try:
        with open(args.out, "wb") as f:
            f.write(data)
    except OSError as e:
        print(f"plot_png: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
