"""A regular install serves: the wheel, installed into a fresh virtual environment, trains and samples.

Every other test runs on the editable install (and conftest puts this checkout first on sys.path), so a module or
data file missing from the wheel goes unnoticed there: `service.usage` once was, and every `pip install` of the
package could not start `together-train serve`. This test builds the wheel (`pip wheel --no-deps .`), installs it
with its `server` and `cookbook` extras into a new venv (torch 2.13.0 first, the CPU wheel where one is on disk, as
scripts/setup.sh does), and from a directory outside the checkout, with no PYTHONPATH, runs what a user runs:
`together-train serve --help` through the console script, then `launch_local` on a tiny model with one replica,
one forward_backward + optim_step + weights_sync + sample through the SDK, the dashboard's static files and the
chat template served from the installed package, and the cookbook's recipes importable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What the installed SDK runs against the installed server (a fresh process: nothing from this checkout).
SMOKE = textwrap.dedent(
    """
    import sys, urllib.request
    import numpy as np
    import together_train as tt, together_train_server, together_train_cookbook
    for mod in (tt, together_train_server, together_train_cookbook):
        assert "site-packages" in mod.__file__, mod.__file__  # the installed copy, not a checkout
    import together_train_cookbook.recipes.sft, together_train_cookbook.recipes.rl  # noqa: F401
    import together_train_server.service.usage  # noqa: F401  (the module the hand-kept list once missed)
    model_dir, storage = sys.argv[1], sys.argv[2]
    with tt.launch_local(model=model_dir, generators=1, storage_dir=storage, http_port=0,
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1"]) as client:
        s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        sample = tt.Sample.for_cross_entropy(np.arange(1, 9), np.ones(8, dtype=np.float32))
        fb = s.forward_backward([sample]).result(timeout=300)
        opt = s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=300)
        s.weights_sync().result(timeout=300)
        res = s.sample([1, 2, 3], tt.SamplingParams(max_tokens=4, seed=0, ignore_eos=True)).result(timeout=300)
        assert np.isfinite(fb.loss) and opt.step == 1, (fb.loss, opt.step)
        assert res.policy_version == 1 and len(res.sequences[0].tokens) == 4, res
        page = urllib.request.urlopen(client.http_url + "/", timeout=60).read().decode()
        assert "<html" in page.lower(), page[:200]
        css = urllib.request.urlopen(client.http_url + "/dashboard/static/dashboard.css", timeout=60).read()
        assert css, "the dashboard's stylesheet is missing from the wheel"
    print("SMOKE OK loss=%.4f step=%d tokens=%s" % (fb.loss, opt.step, res.sequences[0].tokens))
    """
)


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow
def test_wheel_in_fresh_venv_serves_trains_and_samples(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(wheels)], env, tmp_path, 600)
    (wheel,) = wheels.glob("together_train-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env, tmp_path, 120)
    py = str(venv / "bin" / "python")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # torch first, pinned as the server extra pins it, so pip takes the CPU wheel and never a CUDA build.
    _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], env, tmp_path, 900)
    _run([py, "-m", "pip", "install", "-q", f"{wheel}[server,cookbook]"], env, tmp_path, 900)
    help_text = _run([str(venv / "bin" / "together-train"), "serve", "--help"], env, tmp_path, 300)
    assert "--model" in help_text
    out = _run([py, "-c", SMOKE, str(tiny_model_dir), str(tmp_path / "storage")], env, tmp_path, 900)
    assert "SMOKE OK" in out, out
