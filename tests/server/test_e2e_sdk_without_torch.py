"""`pip install .` (no extras) gives an SDK that trains and samples through a server, with no torch.

A fresh virtual environment gets the base install only; a script run there
talks to the real resource process of the `resource` fixture.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import textwrap
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys
    import numpy as np
    import together_train as tt
    assert importlib.util.find_spec("torch") is None, "torch must not be installed here"
    client = tt.ResourceClient(sys.argv[1])
    session = client.create_session(lora=tt.LoraConfig(rank=2))
    toks = np.arange(1, 12)
    sample = tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": np.ones(10, np.float32)})
    fb = session.forward_backward([sample], "cross_entropy")
    opt = session.optim_step(tt.AdamParams(learning_rate=1e-3))
    print("loss", fb.result(timeout=60).loss, "step", opt.result(timeout=60).step)
    session.weights_sync().result(timeout=60)
    res = session.sample([1, 2, 3], tt.SamplingParams(max_tokens=3, seed=0)).result(timeout=60)
    print("version", res.policy_version, "tokens", res.sequences[0].tokens)
    session.stop()
    """
)


@pytest.mark.timeout(600)
def test_base_install_talks_to_server_without_torch(resource, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([py, "-m", "pip", "install", "-q", str(ROOT)], check=True, env=env, cwd=tmp_path, timeout=480)
    out = subprocess.run(
        [py, "-c", SCRIPT, resource.address], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "step 1" in out.stdout and "version 1" in out.stdout
