"""One launch of ``tests/scripts/hf_train.py`` over many (model, mode) cases on 2 ranks, shared by the transformers
and timm tests: every case ran on both ranks, without error, equal to one process and reloading into a fresh model."""
import json

from procutil import SCRIPTS, autopar_cmd

TOL = 1e-9  # float64: exact math shows as ~1e-14


def train_cases(procs, tmp_path, cases: list[list[str]]):
    """Yields (rank, "model/mode", result) for every case once the common checks passed."""
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "hf_train.py"), str(tmp_path / "out"), json.dumps(cases)), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(2):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert sorted(results) == sorted(f"{m}/{mode}" for m, mode in cases)
        for case, r in results.items():
            assert "error" not in r, (rank, case, r.get("error"), r.get("trace"))
            assert r["param"] <= TOL and r["state_dict_reload"] <= TOL, (rank, case, r)
            yield rank, case, r
