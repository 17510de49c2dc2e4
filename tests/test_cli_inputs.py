"""Command-line inputs that printed tracebacks or were silently taken (issue 33, items 4, 6 and 7): each is one
line now, or does what was asked."""
from autopar.cli.main import main


def one_line_error(capsys, argv, message):
    """``autopar ARGV`` (the command's own entry, in this process: these fail before starting anything)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"autopar: error: {err.strip()[len('autopar: error: '):]}" and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_launch_flags(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    cases = [
        (["--port", "70000"], "--port 70000 is not a TCP port (1..65535)"),  # it ran on port 4464
        (["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "70000"],
         "--master-port 70000 is not a TCP port"),
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
        (["--log-dir", str(afile)], f"--log-dir {afile}: a file is in the way"),
        (["--log-dir", str(afile / "logs")], f"--log-dir {afile / 'logs'}: cannot create it: Not a directory"),
    ]
    for flags, message in cases:
        one_line_error(capsys, ["launch", "-n", "2", *flags, str(script)], message)


def test_plan_and_ckpt_paths(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_error(capsys, ["plan", "nosuch.py:build", "-n", "2", "--no-calibrate"],
                   "model file not found: nosuch.py")  # it said "unknown model"
    broken = tmp_path / "broken.py"
    broken.write_text("def build():\n    raise ValueError('my model is broken')\n")
    one_line_error(capsys, ["plan", f"{broken}:build", "-n", "2", "--no-calibrate"],
                   f"{broken}:build() raised ValueError: my model is broken")
    one_line_error(capsys, ["plan", "mlp", "-n", "2", "--width", "64", "--no-calibrate", "--out",
                            str(afile / "plan.json")], f"--out {afile / 'plan.json'}: a file is in the way")
    one_line_error(capsys, ["ckpt", "merge", str(tmp_path), "--out", str(afile / "m.ckpt")],
                   f"--out {afile / 'm.ckpt'}: a file is in the way")
    one_line_error(capsys, ["ckpt", "merge", str(tmp_path / "missing"), "--out", str(tmp_path / "m.ckpt")],
                   "checkpoint not found")


def test_synthetic_data_is_reused_only_at_the_size_asked(tmp_path, capsys):
    """`autopar train --synthetic-records 48` after a 24-record run trained on the 24 records."""
    from autopar.cli.train import synthetic_data
    from autopar.dataset.synth import synthetic_records

    out = synthetic_data(str(tmp_path), 24)
    assert synthetic_records(out) == 24
    capsys.readouterr()
    synthetic_data(str(tmp_path), 24)
    assert "writing" not in capsys.readouterr().out  # the same size: reused
    synthetic_data(str(tmp_path), 48)
    assert "replacing the 24-record one" in capsys.readouterr().out
    assert synthetic_records(out) == 48
    (out / "cifar-10-batches-bin" / "test_batch.bin").write_bytes(b"\0" * 100)  # damaged: written again
    assert synthetic_records(out) is None
    synthetic_data(str(tmp_path), 48)
    assert synthetic_records(out) == 48
