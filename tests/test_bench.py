"""The benchmark runs end to end on tiny sizes (so it cannot rot); no timing is asserted."""
import importlib.util
import json

import numpy as np
import pytest

from gdn_ext.apps import bench


def test_bench_quick_writes_json_and_plot(tmp_path, capsys):
    argv = ["--quick", "--json", str(tmp_path / "b.json")]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(tmp_path / "b.png")]
    except ImportError:
        pass
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    for words in ("gdn_ext forward (float32)", "numpy matmul 1024^3", "T sweep", "thread sweep",
                  "decode", "backward extra memory", "padded batch against ordinary inputs"):
        assert words in out
    res = json.loads((tmp_path / "b.json").read_text())
    assert set(res["tables"]) == {"float32", "float64"}
    for table in res["tables"].values():
        assert table["matmul_gflops"] > 0 and table["backward_over_forward"] > 0
        assert all(r["seconds"] > 0 for r in table["rows"])
    assert [s["T"] for s in res["sweep_T"]] == [256, 1024]
    rows = [r for t in res["tables"].values() for r in t["rows"]]
    assert all(r["runs"] >= 1 and r["spread"] >= 1.0 and r["noisy"] == (r["spread"] > bench.NOISY)
               for r in rows)
    assert all(r["runs"] == 3 for r in rows if r["group"] == "gdn_ext")   # quick: 3 runs each
    assert "--quick: tiny sizes, a smoke test" in out
    assert [r["dtype"] for r in res["padded_batch"]] == ["float32", "float64"]
    assert all(r["forward_ratio"] > 0 and r["backward_ratio"] > 0 for r in res["padded_batch"])
    assert res["backward_memory"]["gdn_ext_backward_extra_bytes"] > 0
    if "--plot" in argv:
        assert (tmp_path / "b.png").stat().st_size > 1000


def test_bench_rows_include_the_peers(capsys):
    pytest.importorskip("torch")
    bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "reference loop in torch, forward" in out


def test_bench_targets_rows(tmp_path, capsys):
    """``bench --targets``: a row per training target (1 to 5), each a positive ratio with its
    bound and whether it is met."""
    assert bench.main(["--targets", "--quick", "--json", str(tmp_path / "t.json")]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["training_targets"]["rows"]
    assert {r["target"] for r in rows} >= {"1", "2", "4", "5"}
    assert all(r["value"] > 0 and r["met"] in (True, False) for r in rows)
    out = capsys.readouterr().out
    assert "backward with checkpoints / forward" in out and "decode step in place" in out
    assert "decode step into out= / in place" in out
    chunk_rows = json.loads((tmp_path / "t.json").read_text())["chunk_targets"]["rows"]
    assert {r["target"] for r in chunk_rows} >= {"P", "C3", "C4", "C5"}
    assert sum(r["target"] == "P" for r in chunk_rows) == 4   # 2 products x 2 dtypes
    res = json.loads((tmp_path / "t.json").read_text())
    if importlib.util.find_spec("torch") is not None:   # one layer's training speed, both dtypes
        tp = res["training_throughput"]
        assert {r["dtype"] for r in tp} == {"float32", "float64"}
        assert all(r["tokens_per_s"] > 0 and np.isclose(r["tokens_per_s"] * r["seconds"], r["T"])
                   and np.isclose(r["tokens_per_s_per_core"] * r["threads"], r["tokens_per_s"])
                   for r in tp)
        assert "tokens/s per core" in out


def test_mm_rate_takes_sizes_and_refuses_bad_ones():
    """The chunk products' rate probe behind the bench's "P" rows: a positive GFLOP/s for any
    size in range, a ValueError naming it for the rest."""
    from gdn_ext import _core
    for dt in (False, True):
        assert _core.mm_rate(dt, 5, 19, 3, 0.01) > 0     # edges: a tile's rows, a vector's tail
    for bad in ((0, 16, 8), (8, 0, 8), (8, 16, 0), (8, 16, 5000)):
        with pytest.raises(ValueError, match="mm_rate: m, n, k"):
            _core.mm_rate(False, *bad, 0.01)
    with pytest.raises(ValueError, match="seconds"):
        _core.mm_rate(True, 8, 8, 8, 0.0)
