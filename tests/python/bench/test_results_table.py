"""tests/bench/RESULTS.md's table is generated from tests/bench/results/current.json
by tests/bench/results_table.py: the committed table must be what the JSON gives,
every figure must carry all its fields, and each must name a section of
tests/bench/results/HISTORY.md (where its details are)."""

import json
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "results_table.py"
CURRENT = BENCH / "results" / "current.json"
HISTORY = BENCH / "results" / "HISTORY.md"
FIELDS = {"target", "figure", "met", "requirement", "command", "machine", "commit", "date",
          "section"}


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_committed_table_is_what_current_json_gives():
    r = run("--check")
    assert r.returncode == 0, r.stderr


def test_every_figure_has_its_fields_and_a_history_section():
    entries = json.loads(CURRENT.read_text(encoding="utf-8"))
    assert isinstance(entries, list) and entries
    headings = {m.group(1).strip() for m in
                re.finditer(r"^## (.+)$", HISTORY.read_text(encoding="utf-8"), re.M)}
    targets = [e.get("target") for e in entries]
    assert len(targets) == len(set(targets)), "a target listed twice"
    for e in entries:
        assert set(e) == FIELDS, (e.get("target"), sorted(set(e) ^ FIELDS))
        assert e["met"] in (True, False, None), e["target"]
        for k in FIELDS - {"met"}:
            assert isinstance(e[k], str) and e[k].strip(), (e["target"], k)
        assert e["section"] in headings, (e["target"], e["section"])


def test_check_fails_on_a_stale_table_and_the_rewrite_keeps_the_rest(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text((BENCH / "RESULTS.md").read_text(encoding="utf-8"), encoding="utf-8")
    entries = json.loads(CURRENT.read_text(encoding="utf-8"))
    entries[0]["figure"] = "9.99 x fio | a new run"
    changed = tmp_path / "current.json"
    changed.write_text(json.dumps(entries), encoding="utf-8")
    args = ("--json", str(changed), "--results", str(results))
    assert run("--check", *args).returncode == 1
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert run("--check", *args).returncode == 0
    text = results.read_text(encoding="utf-8")
    assert "9.99 x fio \\| a new run" in text  # a pipe in a cell is escaped
    assert text.endswith((BENCH / "RESULTS.md").read_text(encoding="utf-8").split(
        "<!-- end of generated table -->\n", 1)[1])  # what follows the table is kept
    del entries[0]["machine"]
    changed.write_text(json.dumps(entries), encoding="utf-8")
    r = run("--check", *args)
    assert r.returncode == 2 and "machine" in r.stderr
