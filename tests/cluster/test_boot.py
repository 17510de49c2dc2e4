"""The launcher's boot hook (autopar/cluster/boot/sitecustomize.py): every rank's script -- one that never imports
autopar too -- leaves its verdict for the launcher, and a site's own ``sitecustomize`` still runs."""
import os
import subprocess
import sys

import pytest

from autopar.cluster.boot import BOOT_DIR
from autopar.cluster.boot.sitecustomize import END_MARK

CASES = [
    ("print('hi')", "ok"),
    ("import sys; sys.exit(0)", "ok"),
    ("import sys; sys.exit(3)", "failed"),
    ("exit('bye')", "failed"),
    ("raise RuntimeError('boom')", "failed"),
    # a child the script starts leaves its own verdict, under its own pid: the script's stays its own
    ("import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass']); raise KeyError(1)", "failed"),
]


@pytest.mark.parametrize("code,verdict", CASES)
def test_a_script_leaves_its_verdict_and_the_sites_hook_still_runs(tmp_path, code, verdict):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = '1'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([BOOT_DIR, str(site)]), **{END_MARK: str(tmp_path / "mark")})
    script = f"import os\nassert os.environ.get('SITE_RAN') == '1', 'site hook'\n{code}\n"
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    marks = {p.name.split(".", 1)[1]: p.read_text().strip() for p in tmp_path.glob("mark.*")}
    assert "site hook" not in err, err
    assert marks.pop(str(proc.pid)) == verdict, (marks, err)
    assert all(v == "ok" for v in marks.values()) and len(marks) == code.count("subprocess.run"), marks


def test_without_a_mark_to_write_the_hook_only_hands_on(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != END_MARK}
    env["PYTHONPATH"] = BOOT_DIR
    proc = subprocess.run([sys.executable, "-c", "import sys, atexit; print(sys.excepthook is sys.__excepthook__)"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    assert not list(tmp_path.iterdir())
