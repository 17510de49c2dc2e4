"""autopar's own dataset through the PyTorch door: labels of every dtype (Cifar10Dataset yields uint32) reach torch's
losses, the metrics and every collective in every mode -- train, eval and predict -- with the int64 run's results."""
import json

from procutil import SCRIPTS, autopar_cmd


def test_label_dtypes_in_every_mode_and_collective(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "label_dtypes.py"), str(tmp_path / "out")), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    for rank in range(2):
        results = json.load(open(tmp_path / f"out.{rank}"))
        assert len(results) == 4 * 4 * 8 + 4 + 6, sorted(results)
        bad = {k: v for k, v in results.items() if "error" in v}
        assert not bad, json.dumps(bad, indent=1)
        for key, r in results.items():
            if key.startswith("collective/"):
                dtype = "torch." + key.split("/")[1]
                assert r["gather_dtype"] == dtype and r["sum_dtype"] == dtype, (key, r)
                assert r["gather_exact"] and r["broadcast_exact"] and r["sum_exact"], (key, r)
            elif key.startswith("regression/"):
                assert r["loss_dtypes"] == ["torch.float32"], (key, r)
            else:
                assert r["loss_vs_int64"] <= 1e-6 and r["pred_shape"] == [4, 5], (key, r)
