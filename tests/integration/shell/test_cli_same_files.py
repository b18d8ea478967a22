"""`python -m run` tunes CPython's garbage collector for its own process (run.py, issue 27: plan +
simulate + print in < 5 s); a library caller keeps the defaults. Both write the same files, byte
for byte: when the collector runs changes nothing memwall computes or draws."""
from __future__ import annotations

import gc
import subprocess
import sys


FILES = ("plan.json", "results.json", "trace.json", "memory.png", "timeline.png")


def test_the_command_and_a_library_call_write_the_same_bytes(tmp_path, capsys):
    from modes import run
    from runconfig import compose

    overrides = ("+hardware=h100_node", "+model=llama3_8b")  # issue 27's preset (policy.recompute=null picks one)
    cli_out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "run", *overrides, f"hydra.run.dir={cli_out}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lib_out = tmp_path / "lib"
    lib_out.mkdir()
    assert gc.get_threshold()[0] < 10_000  # this process keeps CPython's default collector
    run(compose(*overrides), lib_out)
    printed = capsys.readouterr().out
    for name in FILES:
        assert (cli_out / name).read_bytes() == (lib_out / name).read_bytes(), name
    assert printed.replace(str(lib_out), "OUT") == proc.stdout.replace(str(cli_out), "OUT")
