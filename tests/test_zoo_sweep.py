"""The sweep's machinery with a stub worker (the real one imports torch and transformers: ~9 s):
every model type gets a row, a hang or a crash costs that row only and says why, finished rows
are not run again, a worker is replaced after `recycle` rows, and a worker count the machine
cannot hold is refused before anything starts."""
from __future__ import annotations

import json
import sys

import pytest
from trainprobes.budget import TooLarge
from trainprobes.zoo.sweep import load_rows, sweep, to_map

STUB = r'''
import json, os, sys, time
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    mt = line.strip()
    if mt == "hang":
        time.sleep(60)
    marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "once.marker")
    if mt == "once" and not os.path.exists(marker):     # hangs the first time only
        open(marker, "w").close()
        time.sleep(60)
    if mt == "die":
        print("the stub dies", file=sys.stderr, flush=True)
        os._exit(7)
    cell = {"model_type": mt, "probe": "batch", "variant": "", "verdict": "invariant", "number": 0.0,
            "what": "", "reason": f"pid {os.getpid()}", "expected": None, "finding": False, "seconds": 0.0}
    print(json.dumps({"model_type": mt, "cells": [cell], "seconds": 0.01, "peak_rss_mb": 1.0}), flush=True)
'''


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "stub.py"
    path.write_text(STUB)
    return [sys.executable, str(path)]


def test_every_type_gets_a_row_and_a_hang_or_crash_costs_one_row(tmp_path, stub):
    lines = []
    rows = sweep(["a", "hang", "b", "die", "c"], tmp_path / "rows.jsonl", workers=2, timeout=2,
                 memory_mb=0, progress=lines.append, command=stub)
    assert sorted(rows) == ["a", "b", "c", "die", "hang"]
    hang, die = rows["hang"]["cells"][0], rows["die"]["cells"][0]
    # a hang is tried twice (the second at the end of the queue), then kept as a timeout
    assert hang["verdict"] == "error" and hang["reason"].startswith("timeout: no row after 2 s")
    assert "try 2 of 2" in hang["reason"] and rows["hang"]["tries"] == 2
    assert die["verdict"] == "error" and "worker exited 7" in die["reason"] and "the stub dies" in die["reason"]
    assert all(rows[m]["cells"][0]["verdict"] == "invariant" for m in "abc")
    assert len(lines) == 7 and lines[-1].startswith("[6/6] hang")
    assert sum("measured once more at the end" in ln for ln in lines) == 1
    assert "the stub dies" in (tmp_path / "rows.log").read_text()   # the workers' stderr, kept


def test_a_row_that_timed_out_is_measured_once_more_in_the_run_or_on_resume(tmp_path, stub):
    jsonl = tmp_path / "rows.jsonl"
    lines = []
    rows = sweep(["a", "once"], jsonl, workers=1, timeout=2, memory_mb=0, progress=lines.append, command=stub)
    assert rows["once"]["cells"][0]["verdict"] == "invariant" and rows["once"]["tries"] == 2
    assert any(ln.startswith("[2/3] once: timed out") for ln in lines)
    assert [json.loads(ln)["model_type"] for ln in jsonl.read_text().splitlines()] == ["a", "once", "once"]
    # resume: a row stored as a first timeout (an earlier sweep killed before its second try)
    # is measured once more; one stored after its second try is kept
    first_try = dict(json.loads(jsonl.read_text().splitlines()[1]), model_type="b")
    first_try["cells"] = [dict(first_try["cells"][0], model_type="b")]
    second_try = dict(first_try, model_type="c", tries=2, cells=[dict(first_try["cells"][0], model_type="c")])
    with jsonl.open("a") as f:
        f.write(json.dumps(first_try) + "\n" + json.dumps(second_try) + "\n")
    lines = []
    rows = sweep(["a", "b", "c"], jsonl, workers=1, timeout=2, memory_mb=0, progress=lines.append, command=stub)
    assert "1 of them timed out before and are measured once more: b" in lines[0]
    assert rows["b"]["cells"][0]["verdict"] == "invariant" and rows["b"]["tries"] == 2
    assert rows["c"]["cells"][0]["reason"].startswith("timeout: ") and len(lines) == 2


def test_finished_rows_are_not_run_again(tmp_path, stub):
    jsonl = tmp_path / "rows.jsonl"
    sweep(["a", "b"], jsonl, workers=1, memory_mb=0, progress=None, command=stub)
    before = jsonl.read_text()
    lines = []
    rows = sweep(["a", "b", "c"], jsonl, workers=1, memory_mb=0, progress=lines.append, command=stub)
    assert jsonl.read_text().startswith(before) and len(jsonl.read_text().splitlines()) == 3
    assert lines[0].startswith("zoo: 2 rows already") and sorted(rows) == ["a", "b", "c"]
    assert sorted(load_rows(jsonl)) == ["a", "b", "c"]


def test_a_row_measured_under_another_release_is_measured_again_and_every_row_names_its_versions(tmp_path, stub):
    jsonl = tmp_path / "rows.jsonl"
    sweep(["a", "b"], jsonl, workers=1, memory_mb=0, progress=None, command=stub)
    first, second = jsonl.read_text().splitlines()
    old = dict(json.loads(second), versions={"transformers": "5.24.0", "torch": "2.13.0"})
    jsonl.write_text(first + "\n" + json.dumps(old) + "\n")      # b from a sweep before an upgrade
    lines = []
    rows = sweep(["a", "b"], jsonl, workers=1, memory_mb=0, progress=lines.append, command=stub)
    assert "1 rows of" in lines[0] and "measured again" in lines[0]
    m = to_map(rows)
    here = {k: m["versions"][k] for k in ("transformers", "torch")}
    assert m["row_versions"] == {"a": here, "b": here}


def test_a_row_cut_short_by_a_kill_is_measured_again_and_breaks_no_line(tmp_path, stub):
    """Killed while writing a row: the unterminated tail is not a row (resume used to raise a
    JSONDecodeError), and the rows appended next do not continue its line."""
    jsonl = tmp_path / "rows.jsonl"
    sweep(["a", "b"], jsonl, workers=1, memory_mb=0, progress=None, command=stub)
    first, second = jsonl.read_text().splitlines()
    jsonl.write_text(first + "\n" + second[:len(second) // 2])
    lines = []
    rows = sweep(["a", "b", "c"], jsonl, workers=1, memory_mb=0, progress=lines.append, command=stub)
    assert sorted(rows) == ["a", "b", "c"] and "dropped an unfinished last row" in lines[0]
    assert sorted(load_rows(jsonl)) == ["a", "b", "c"]
    assert [json.loads(line)["model_type"] for line in jsonl.read_text().splitlines()] == ["a", "b", "c"]
    jsonl.write_text(first + "\nnot a row\n")              # damage inside the file: refused
    from trainprobes.errors import DataFileError
    with pytest.raises(DataFileError, match="rows.jsonl:2: not a zoo row"):
        load_rows(jsonl)


def test_a_worker_is_replaced_after_recycle_rows(tmp_path, stub):
    rows = sweep(list("abcde"), tmp_path / "rows.jsonl", workers=1, recycle=2, memory_mb=0,
                 progress=None, command=stub)
    pids = [rows[m]["cells"][0]["reason"] for m in "abcde"]
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]


def test_a_sweep_the_machine_cannot_hold_is_refused_before_it_starts(tmp_path, stub, monkeypatch):
    import trainprobes.budget as budget
    monkeypatch.setattr(budget, "available_bytes", lambda: 1 << 30)
    with pytest.raises(TooLarge, match="fewer --workers"):
        sweep(["a"], tmp_path / "rows.jsonl", workers=4, progress=None, command=stub)
    assert not (tmp_path / "rows.jsonl").exists()


def test_the_map_holds_versions_rows_and_the_largest_peak(tmp_path, stub):
    rows = sweep(["b", "a"], tmp_path / "rows.jsonl", workers=1, memory_mb=0, progress=None, command=stub)
    m = to_map(rows, wall_seconds=1.5)
    assert list(m["rows"]) == ["a", "b"] and m["peak_rss_mb"] == 1.0 and m["wall_seconds"] == 1.5
    assert m["versions"]["transformers"] and json.loads(json.dumps(m)) == m


@pytest.mark.parametrize("kw, says", [
    # select() raised ValueError in every worker thread: no row, and the script wrote an empty map, exit 0
    (dict(timeout=-1), "timeout=-1"),
    (dict(timeout=0), "timeout=0"),          # every row a timeout
    (dict(recycle=0), "recycle=0"),           # a new worker (torch and transformers imported) per row
    # every worker died at start (address space of 1 MiB): 196 error rows, exit 0
    (dict(memory_mb=1), "memory_mb=1 MiB is below the 1402 MiB")])
def test_settings_that_cannot_measure_a_row_are_refused_before_it_starts(tmp_path, stub, kw, says):
    from trainprobes.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match=says):
        sweep(["a"], tmp_path / "rows.jsonl", workers=1, progress=None, command=stub,
              **dict(dict(memory_mb=0), **kw))
    assert not (tmp_path / "rows.jsonl").exists()


def test_the_script_refuses_a_model_type_transformers_does_not_register(tmp_path, monkeypatch, capsys):
    """A typo was swept as a row of one failed build, exit 0 (',,' as a row named '')."""
    import runpy
    from pathlib import Path
    script = Path(__file__).parents[1] / "scripts" / "zoo_sweep.py"
    monkeypatch.setattr(sys, "argv", ["zoo_sweep.py", "--models", "llama,mixtrl", "--jsonl", str(tmp_path / "r.jsonl"),
                                      "--out", str(tmp_path / "m.json")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    err = capsys.readouterr().err
    from trainprobes.zoo.shrink import causal_lm_types
    n = len(causal_lm_types())   # read from the installed registry (5.24: 196, 5.25: 200)
    assert e.value.code == 2 and (f"'mixtrl' is not a causal-LM model type of this transformers ({n} registered); "
                                  "close: mixtral") in err, (e.value.code, err[-500:])
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "m.json").exists()
