#!/usr/bin/python3
"""Line plots as PNG files for the benchmark scripts (throughput against the
number of trainers, one panel per scenario), drawn by matplotlib (Debian's
python3-matplotlib, deploy/install-deps.sh) with the non-interactive Agg
backend.

    /usr/bin/python3 tests/bench/plot.py SPEC.json OUT.png
    import plot; plot.write(spec, "out.png")

SPEC: {"title": "...", "panels": [{"title": "...", "x_label": "...",
"y_label": "...", "series": [{"name": "...", "points": [[x, y], ...],
"dashed": false}, ...]}, ...]}. Panels are drawn side by side, each
PANEL_SIZE inches at DPI; a series name keeps its colour in every panel; y
starts at 0 (lower if a value is negative).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANEL_SIZE = (6.4, 4.8)  # inches per panel
DPI = 100                # so one panel is 640 x 480 pixels


def write(spec, path):
    """Draws `spec` and writes the PNG to `path`."""
    panels = spec["panels"]
    if not panels:
        raise ValueError("spec has no panels")
    fig, axes = plt.subplots(1, len(panels), squeeze=False, dpi=DPI,
                             figsize=(PANEL_SIZE[0] * len(panels), PANEL_SIZE[1]))
    colours = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    try:
        for ax, panel in zip(axes[0], panels):
            xs_all, ys_all = set(), []
            for s in panel["series"]:
                colour = colours.setdefault(s["name"], cycle[len(colours) % len(cycle)])
                xs = [float(p[0]) for p in s["points"]]
                ys = [float(p[1]) for p in s["points"]]
                ax.plot(xs, ys, marker="s", color=colour, label=s["name"],
                        linestyle="--" if s.get("dashed") else "-")
                xs_all.update(xs)
                ys_all += ys
            ax.set_title(panel.get("title", ""))
            ax.set_xlabel(panel.get("x_label", ""))
            ax.set_ylabel(panel.get("y_label", ""))
            ax.set_ylim(bottom=min([0.0] + ys_all))
            if len(xs_all) <= 10:
                ax.set_xticks(sorted(xs_all))
            ax.grid(True, color="#e4e4e4")
            ax.legend(loc="best", fontsize="small")
        if spec.get("title"):
            fig.suptitle(spec["title"], fontweight="bold")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def main(argv):
    if len(argv) != 2:
        print("usage: plot.py SPEC.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        write(json.load(f), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
