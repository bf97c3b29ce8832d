"""Two processes in one mesh (jax.distributed on localhost, 4 CPU devices each): each
writes and reads only its own shards of a checkpoint. (Training on two processes:
tests/e2e/test_faults.py.)"""

import os
import subprocess
import sys

from tests import cli


def test_two_processes_write_their_own_shards_and_read_back_theirs(tmp_path, env):
    """2 processes x 4 CPU devices (jax.distributed on localhost) save at (2, 2, 2) and
    restore at (1, 8, 1) and (4, 1, 2); each process reads only its rows of a batch."""
    script = str(cli.REPO / "tests" / "e2e" / "multihost_checkpoint.py")
    env = dict(env, PYTHONPATH=str(cli.REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    port, folder = cli.free_port(), str(tmp_path / "ckpt")
    procs = [subprocess.Popen([sys.executable, script, str(i), str(port), folder], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and "OK" in out, out[-3000:]
    # Each process wrote its own shard files; between them they hold rows 0-7 and 8-15.
    assert {d for d in os.listdir(os.path.join(folder, "0", "state"))
            if d.startswith("ocdbt.process_")} == {"ocdbt.process_0", "ocdbt.process_1"}
    assert "rows=0..7 n=8" in outputs[0] and "rows=8..15 n=8" in outputs[1]
