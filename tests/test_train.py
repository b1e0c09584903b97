"""The main job: a tiny training run must learn (loss falls), and the CLI must work end to end."""
import numpy as np
import pytest

from gdn_ext.apps import lm, train


def test_loss_falls_on_a_tiny_run():
    text = lm.load_text()[:60_000]
    res = train.train(text, steps=60, d_model=32, n_layers=1, n_heads=2, d_head=8, batch=8,
                      seq_len=32, lr=1e-2, eval_every=30, sample_len=20, progress=False,
                      log=lambda *a: None)
    losses = np.array(res["history"]["train"])
    assert losses[:5].mean() > np.log(len(res["vocab"])) - 0.5       # starts near chance
    assert losses[-10:].mean() < losses[:5].mean() - 1.0              # and learns
    assert res["val_loss"] < res["baseline"]                          # beats the unigram model
    assert res["sample"].startswith("The ") and len(res["sample"]) == 4 + 20


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys):
    """A log file (stderr redirected) gets no progress bar, though one was asked for."""
    pytest.importorskip("tqdm")
    train.train(lm.load_text()[:20_000], steps=3, d_model=16, n_layers=1, n_heads=1, d_head=8,
                batch=2, seq_len=16, eval_every=3, sample_len=4, progress=True,
                log=lambda *a: None)
    err = capsys.readouterr().err
    assert "step/s" not in err and "%|" not in err, err[:200]


def test_plot_title_names_the_rules_it_compares():
    """--rule all draws four rules in one figure: its title names them all, not one."""
    from gdn_ext.layer import RULES
    assert train.plot_title([""]) == train.plot_title(["gated_delta"]) == "Gated DeltaNet"
    everything = train.plot_title(list(RULES))
    assert everything == "linear attention, DeltaNet, gated linear attention and Gated DeltaNet"
    assert set(train.RULE_TITLES) == set(RULES)


def test_unigram_baseline_and_cross_entropy():
    ids = np.array([0, 0, 1, 2])
    # add-one smoothed frequencies of train = [2+1, 1+1, 1+1] / 7
    assert lm.unigram_baseline(ids, np.array([0]), 3) == pytest.approx(-np.log(3 / 7))
    logits = np.array([[0.0, 0.0], [np.log(3.0), 0.0]])
    loss, d = lm.cross_entropy(logits, np.array([0, 1]))
    assert loss == pytest.approx(0.5 * (np.log(2) + np.log(4)))
    np.testing.assert_allclose(d, [[-0.25, 0.25], [0.375, -0.375]])


def test_cli_trains_on_a_text_file(tmp_path, capsys):
    from gdn_ext.__main__ import main
    path = tmp_path / "tiny.txt"
    path.write_text(lm.load_text()[:40_000], encoding="utf-8")
    argv = ["--text", str(path), "--steps", "40", "--d-model", "32", "--layers", "1", "--heads",
            "2", "--head-dim", "8", "--batch", "8", "--seq-len", "32", "--lr", "1e-2",
            "--no-progress", "--threads", "1"]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(tmp_path / "loss.png")]
    except ImportError:
        pass
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "validation loss" in out and "below" in out and "sample:" in out
    if "--plot" in argv:
        assert (tmp_path / "loss.png").stat().st_size > 1000


def test_cli_rejects_a_missing_file(tmp_path):
    from gdn_ext.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(["--text", str(tmp_path / "nope.txt")])
    assert info.value.code == 2


def test_cli_text_without_the_default_prompt(tmp_path, capsys):
    """A text that cannot spell the default prompt "The " still samples (from its own start)."""
    from gdn_ext.__main__ import main
    path = tmp_path / "lower.txt"
    path.write_text("abc abd bcd cab " * 400, encoding="utf-8")
    argv = ["--text", str(path), "--steps", "30", "--d-model", "16", "--layers", "1", "--heads",
            "1", "--head-dim", "8", "--batch", "4", "--seq-len", "16", "--lr", "1e-2",
            "--no-progress"]
    assert main(argv) == 0
    assert "sample:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [
    (["--lr", "nan"], "must be a positive finite number"),
    (["--lr", "-1"], "must be a positive finite number"),
    (["--steps", "0"], "must be a positive integer"),
])
def test_cli_rejects_bad_flags(argv, words, capsys):
    from gdn_ext.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_cli_short_text_and_missing_matplotlib(tmp_path, monkeypatch, capsys):
    from gdn_ext.__main__ import main
    path = tmp_path / "short.txt"
    path.write_text("abcdefghij" * 5, encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        main(["--text", str(path)])
    assert info.value.code == 2 and "needs at least 1300" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)   # import fails
    with pytest.raises(SystemExit) as info:
        main(["--plot", str(tmp_path / "x.png")])
    assert info.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err


def test_cli_compares_rules(tmp_path, capsys):
    """--rule trains one model per rule, same sizes, seed and steps, and prints a table."""
    from gdn_ext.__main__ import main
    path = tmp_path / "tiny.txt"
    path.write_text(lm.load_text()[:40_000], encoding="utf-8")
    argv = ["--text", str(path), "--steps", "100", "--d-model", "32", "--layers", "1", "--heads",
            "2", "--head-dim", "8", "--batch", "8", "--seq-len", "32", "--lr", "1e-2",
            "--no-progress", "--threads", "1", "--rule", "linear", "gated_delta"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("rule "):].splitlines()
    assert table[1].startswith("linear") and table[2].startswith("gated_delta")
    assert table[1].split()[-1] == table[2].split()[-1]          # same number of parameters
    assert "(linear rule)" in out and "(gated_delta rule)" in out


def test_lm_rules_differ_and_ungated_ignores_the_gate():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (2, 12))
    y = rng.integers(0, 20, (2, 12))
    losses = {}
    for rule in ("linear", "delta", "gated_linear", "gated_delta"):
        m = lm.CharLM.init(20, d_model=16, n_layers=1, n_heads=2, d_head=4, seed=1, rule=rule)
        loss, grads = m.loss_and_grads(x, y, num_threads=1)
        losses[rule] = loss
        names = [n for n, _ in m.layers[0]]
        dWg = grads[1 + names.index("Wg_state")]
        assert (np.abs(dWg).max() == 0) == (rule in ("linear", "delta")), rule
    assert len({round(v, 10) for v in losses.values()}) == 4
    with pytest.raises(ValueError, match="rule must be one of"):
        lm.CharLM.init(20, rule="mamba")
