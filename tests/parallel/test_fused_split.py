"""A column-split fused q, k, v projection on 2 ranks (tests/scripts/fused_split.py), float64 against one process:
nanoGPT's ``split`` with heads the ranks divide runs attention split by heads; with heads they do not (3 over 2), q,
k and v are gathered whole as DTensor does; BLOOM's heads-first layout splits the heads where they lie. Exact in each."""
import json

from procutil import SCRIPTS, autopar_cmd


def test_fused_projections_split_by_heads_where_the_ranks_divide_them(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "fused_split.py"), str(tmp_path / "out")), timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(2):
        out = json.load(open(tmp_path / f"out.{rank}"))
        for case, r in out.items():
            assert r["loss"] <= 1e-12 and r["grad"] <= 1e-12, (case, r)
        # split by heads: half the features reach the row-split projection; 3 heads over 2 ranks: whole
        assert out["nanogpt4"]["attended"]["local"] * 2 == out["nanogpt4"]["attended"]["whole"], out
        assert out["heads_first"]["attended"]["local"] * 2 == out["heads_first"]["attended"]["whole"], out
        assert out["nanogpt3"]["attended"]["local"] == out["nanogpt3"]["attended"]["whole"], out
