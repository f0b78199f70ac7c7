"""`trainprobes drift`: files in, verdict first, JSON for machines, plots, exit codes."""
import json

import numpy as np
import pytest
from trainprobes.cli import main


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    train = -rng.random((32, 20)).astype(np.float32) * 3
    np.savez(tmp_path / "a.npz", logprobs=train)
    np.savez(tmp_path / "clean.npz", logprobs=(train + rng.normal(0, 1e-7, train.shape)).clip(max=0).astype(np.float32))
    np.savez(tmp_path / "biased.npz", logprobs=(train + 0.05 + rng.normal(0, 0.01, train.shape)).clip(max=0).astype(np.float32))
    return tmp_path


def test_json_report(files, capsys):
    rc = main(["drift", "--train", str(files / "a.npz"), "--infer", str(files / "biased.npz"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    r = doc["results"][0]
    assert rc == 1 and r["metrics"]["biased"] is True and r["codes"] == ["TP-D1"]
    for key in ("mean_log_ratio", "p_value", "k3_kl", "max_abs_prob_diff", "frac_ratio_outside"):
        assert key in r["metrics"]


def test_human_output_verdict_first_and_plot(files, capsys):
    png = files / "out.png"
    rc = main(["drift", "--train", str(files / "a.npz"), "--infer", str(files / "clean.npz"),
               "--plot", str(png), "--output", str(files / "rep.json")])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("CLEAN  PASS")
    assert "mean_log_ratio" in out and png.stat().st_size > 1000
    from trainprobes.result import load_results
    results, meta = load_results(files / "rep.json")
    assert results[0].metrics["drift_verdict"] == "clean" and meta["command"] == "drift"


def test_threshold_option(files, capsys):
    rc = main(["drift", "--train", str(files / "a.npz"), "--infer", str(files / "clean.npz"),
               "--threshold", "max_abs_log_ratio=1e-9", "--json"])
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert rc == 1 and "TP-D3" in r["codes"]


def test_rollouts_jsonl(tmp_path, capsys):
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps({"token_ids": [1, 2, 3], "infer_logprobs": [-1.0, -0.5, -2.0],
                                       "train_logprobs": [-1.0, -0.5, -2.0]}) for _ in range(4)))
    rc = main(["drift", "--rollouts", str(p), "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["results"][0]["metrics"]["n_tokens"] == 12


@pytest.mark.parametrize("argv, match", [
    (["drift"], "give --train FILE and --infer FILE"),
    (["drift", "--train", "nope.npz", "--infer", "nope.npz"], "does not exist"),
    (["drift", "--train", "A", "--infer", "B", "--threshold", "bogus=1"], "METRIC=MAX"),
])
def test_errors_exit_2_with_a_message(files, capsys, argv, match):
    argv = [a.replace("A", str(files / "a.npz")).replace("B", str(files / "clean.npz")) for a in argv]
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_demo_runs_the_engine_pair(monkeypatch, capsys):
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: one thread is far faster on a shared machine
    from trainprobes.drift import demo
    monkeypatch.setattr(demo, "SCENARIOS", demo.SCENARIOS[:1])  # one scenario keeps CI short
    rc = main(["drift", "--demo", "--demo-prompts", "8", "--demo-tokens", "8", "--progress"])
    cap = capsys.readouterr()
    assert rc == 0 and cap.out.startswith("CLEAN") and "expected clean: yes" in cap.out
    torch.set_num_threads(threads)
    assert cap.err.startswith("drift --demo: started") and "drift --demo: ended, 1/1 scenarios" in cap.err


def test_demo_passes_the_compare_options_and_validates_them(monkeypatch, capsys):
    from trainprobes.drift import demo
    monkeypatch.setattr(demo, "SCENARIOS", demo.SCENARIOS[:1])
    assert main(["drift", "--demo", "--demo-prompts", "4", "--demo-tokens", "4", "--alpha", "3"]) == 2
    assert "alpha=3.0" in capsys.readouterr().err
    rc = main(["drift", "--demo", "--demo-prompts", "4", "--demo-tokens", "4", "--json",
               "--min-bias", "0.5", "--alpha", "0.05"])
    out = capsys.readouterr().out
    assert rc == 0 and '"min_bias": 0.5' in out and '"alpha": 0.05' in out


def _masked(path, real_columns):
    lp = -np.random.default_rng(0).random((40, 40)).astype(np.float32) * 3
    mask = np.zeros(lp.shape, bool)
    mask[:, :real_columns] = True
    np.savez(path, logprobs=lp, mask=mask)


def test_masks_that_differ_are_refused_not_silently_intersected(tmp_path, capsys):
    # was: 1600 -> 1280 tokens without a word
    _masked(tmp_path / "t.npz", 40)
    _masked(tmp_path / "i.npz", 32)
    argv = ["drift", "--train", str(tmp_path / "t.npz"), "--infer", str(tmp_path / "i.npz")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "differ at 320 of 1600 positions (first at record 0, position 32: train True, " \
           "infer False)" in err and "--intersect-masks" in err
    assert main(argv + ["--intersect-masks", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["metrics"]["n_tokens"] == 1280 and "320 train and 0 infer tokens" in r["message"]
    assert "masks differed at 320 positions" in r["evidence"]["masks"]


@pytest.mark.parametrize("content", [b"train,infer\n-1.0,-1.1\n", b""])
def test_a_text_file_named_npz_is_called_what_it_is(tmp_path, capsys, content):
    # was: "Cannot load file containing pickled data when allow_pickle=False"
    (tmp_path / "t.npz").write_bytes(content)
    assert main(["drift", "--train", str(tmp_path / "t.npz"), "--infer", str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err
    assert "is not an .npz archive" in err and "pickled" not in err


def test_json_is_exactly_the_saved_report(files, capsys):
    out = files / "r.json"
    main(["drift", "--train", str(files / "a.npz"), "--infer", str(files / "clean.npz"), "--json",
          "--output", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["command"] == "drift"
    assert printed["options"]["alpha"] == 0.01


@pytest.mark.parametrize("argv, match", [
    (["drift", "--demo", "--train", "A"], "--demo runs its own engine pair"),
    (["drift", "--rollouts", "A", "--train", "A"], "give --rollouts FILE alone"),
    (["drift", "--train", "A"], "(only --train was given)"),
    (["drift", "--alpha", "2", "--demo"], "alpha=2.0 must be a finite number in (0, 1)"),
    (["drift", "--clip", "1", "--demo"], "clip=1.0 must be a finite number > 1"),
    (["drift", "--threshold", "k3kl=1", "--demo"], "did you mean 'k3_kl'?"),
    (["drift", "--threshold", "k3_kl=big", "--demo"], "threshold k3_kl='big' must be a finite"),
])
def test_option_mistakes_exit_2_naming_them(files, capsys, argv, match):
    argv = [a.replace("A", str(files / "a.npz")) for a in argv]
    assert main(argv) == 2
    assert match in capsys.readouterr().err
