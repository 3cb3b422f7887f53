"""Every script in benchmarks/ starts the way the docs run it: `python benchmarks/<name>.py`
from any directory and without PYTHONPATH, where Python puts only the script's own directory on
sys.path (a script that imports `benchmarks.<x>` has to make the repository root importable
itself)."""

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# One interpreter for all scripts (torch is imported once): before each, the modules of
# benchmarks/ are forgotten and sys.path[0] is the script's directory, as for `python script.py`.
RUN_EACH_WITH_HELP = r'''
import runpy, sys
from pathlib import Path
scripts = sorted(Path(sys.argv[1]).glob("*.py"))
local = {p.stem for p in scripts}
failed = []
for path in scripts:
    for name in [m for m in sys.modules if m.split(".")[0] in local | {"benchmarks"}]:
        del sys.modules[name]
    sys.path[0] = str(path.parent)
    sys.argv = [str(path), "--help"]
    try:
        runpy.run_path(str(path), run_name="__main__")
        failed.append(f"{path.name}: --help did not exit")
    except SystemExit as exit:
        if exit.code not in (0, None):
            failed.append(f"{path.name}: exit status {exit.code}")
    except Exception as error:
        failed.append(f"{path.name}: {type(error).__name__}: {error}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
'''


def test_every_benchmark_script_starts_from_any_directory_without_pythonpath(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", RUN_EACH_WITH_HELP, str(BENCHMARKS)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
