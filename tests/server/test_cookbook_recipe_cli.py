"""What every recipe does around its training loop: bad values rejected up front with one line,
``--resume`` checked against the run's saved config, finished runs resumable, sessions stopped
on a crash, resource errors at startup as one line naming the flag (shared tiny-model resource)."""

from __future__ import annotations

import functools
import json

import pytest

import together_train as tt
from together_train_cookbook.checkpoint_refs import resolve_init_from
from together_train_cookbook.cli import ConfigError
from together_train_cookbook.run_state import check_resume_config
from together_train_cookbook.recipes import distill, dpo, rl, sft

RECIPES = {"sft": sft, "rl": rl, "dpo": dpo, "distill": distill}


# -- 3. bad values: one line, flag and value, nothing created ------------------------------


@pytest.mark.parametrize(
    "name,argv,expect",
    [
        ("rl", ["--steps", "-1"], "--steps -1"),
        ("distill", ["--steps", "-3"], "--steps -3"),
        ("sft", ["--steps", "-1"], "--steps -1"),
        ("dpo", ["--batch-size", "0"], "--batch-size 0"),
        ("rl", ["--num-samples", "0"], "--num-samples 0"),
        ("distill", ["--learning-rate", "nan"], "--learning-rate nan"),
        ("sft", ["--learning-rate=-1e-3"], "--learning-rate -0.001"),
        ("dpo", ["--beta", "0"], "--beta 0.0"),
        ("rl", ["--save-every", "-1"], "--save-every -1"),
        ("sft", ["--data", "/nonexistent/chats.jsonl"], "--data /nonexistent/chats.jsonl: no such file"),
        ("rl", ["--loss-config", "{clip: 1"], "--loss-config '{clip: 1': not JSON"),
        ("rl", ["--loss-config", "[1]"], "expected a JSON object"),
        ("dpo", ["--rejected", "sampled", "--data", "x.jsonl"], "--rejected sampled needs a checker"),
    ],
)
def test_bad_values_exit_with_one_line_before_anything_is_created(name, argv, expect, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        RECIPES[name].main(argv + ["--out-dir", str(out)])
    msg = str(e.value.code)
    assert expect in msg and "\n" not in msg, msg
    assert not out.exists()


def test_run_raises_config_error_for_library_callers(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="--steps -1"):
        rl.run(rl.Config(steps=-1, out_dir=str(out)))
    with pytest.raises(ValueError, match="--beta -0.5"):  # ConfigError is a ValueError
        dpo.run(dpo.Config(beta=-0.5, out_dir=str(out)))
    assert not out.exists()


# -- 1. --resume checks the saved config ---------------------------------------------------


def _fake_run_dir(path, cfg):
    """An out dir as a run leaves it after a checkpoint (config.json + states.jsonl)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(dataclass_dict(cfg)))
    (path / "states.jsonl").write_text(json.dumps({"step": 2, "uri": "together-train://s-x/state/y", "extra": {}}) + "\n")


def dataclass_dict(cfg):
    import dataclasses

    return dataclasses.asdict(cfg)


def test_resume_with_different_run_settings_is_refused_and_config_kept(tmp_path):
    """`dpo --init-from RUN --out-dir R` then `dpo --out-dir R --resume` without --init-from (and a
    different --batch-size): refused before any resource or session, naming both values;
    config.json is left as the run wrote it."""
    out = tmp_path / "R"
    _fake_run_dir(out, dpo.Config(init_from="runs/sft10", steps=2, out_dir=str(out)))
    before = (out / "config.json").read_text()
    with pytest.raises(SystemExit) as e:
        dpo.main(["--out-dir", str(out), "--steps", "2", "--resume", "--batch-size", "4"])
    msg = str(e.value.code)
    assert "--init-from: run has 'runs/sft10', now None" in msg
    assert "--batch-size: run has 8, now 4" in msg and "\n" not in msg
    assert (out / "config.json").read_text() == before
    assert not (out / "storage").exists()


def test_fields_that_may_change_on_resume():
    saved = dataclass_dict(rl.Config(steps=4, address="a:1", save_every=2, eval_every=2, stop_after=2))
    check_resume_config(saved, rl.Config(steps=10, address="b:2", resume=True, save_every=5, eval_every=0))
    with pytest.raises(ConfigError, match=r"--learning-rate: run has 0.0001, now 0.001"):
        check_resume_config(saved, rl.Config(learning_rate=1e-3, steps=4))
    with pytest.raises(ConfigError, match="--loss: run has 'importance_sampling', now 'ppo'"):
        check_resume_config(saved, rl.Config(loss="ppo"))
    del saved["loss"]  # a config.json from an older version: fields it lacks are not compared
    check_resume_config(saved, rl.Config(loss="ppo"))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_test_only_flags_are_hidden_from_help_but_accepted(name, capsys):
    """``--stop-after`` exists for the resume tests: out of ``--help``, still parsed."""
    mod = RECIPES[name]
    with pytest.raises(SystemExit):
        mod.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "--steps" in help_text and "--stop-after" not in help_text, help_text
    assert mod.parse_args(["--stop-after", "2"]).stop_after == 2


def _rl_cfg(tiny_model_dir, resource, out, **kw):
    base = dict(model=str(tiny_model_dir), address=resource.address, steps=1, batch_size=2, num_samples=2,
                max_tokens=3, eval_examples=2, eval_every=0, eval_max_tokens=2, save_every=0,
                lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, out_dir=str(out))
    base.update(kw)
    return rl.Config(**base)


# -- 1 + 2. resume from scratch, of a finished run, extended; steps 0 -------------------------


def test_rl_resume_notice_finished_run_extension_and_steps_zero(resource, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    first = rl.run(_rl_cfg(tiny_model_dir, resource, out, resume=True))  # no checkpoint yet: from scratch
    assert "no checkpoint in" in capsys.readouterr().err
    assert first["accuracy_end"] is not None
    again = rl.run(_rl_cfg(tiny_model_dir, resource, out, resume=True))  # finished: used to crash (None format)
    assert again["accuracy_end"] == first["accuracy_end"] and again["steps"] == 1
    assert "RL accuracy" in capsys.readouterr().out
    longer = rl.run(_rl_cfg(tiny_model_dir, resource, out, resume=True, steps=2))  # extending is fine
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [-1, 0, 1]
    assert longer["steps"] == 2 and json.loads((out / "config.json").read_text())["steps"] == 2
    with pytest.raises(ConfigError, match="--batch-size: run has 2, now 3"):
        rl.run(_rl_cfg(tiny_model_dir, resource, out, resume=True, steps=2, batch_size=3))
    assert json.loads((out / "config.json").read_text())["batch_size"] == 2
    zero = rl.run(_rl_cfg(tiny_model_dir, resource, tmp_path / "zero", steps=0))  # 0 = evaluate, save
    assert zero["accuracy_end"] == zero["accuracy_start"] and zero["state_uri"]


def test_distill_resume_of_a_finished_run(resource, tiny_model_dir, tmp_path, capsys):
    def cfg(**kw):
        return distill.Config(model=str(tiny_model_dir), address=resource.address, steps=1, batch_size=2,
                              num_samples=2, max_tokens=3, eval_examples=2, eval_every=0, eval_max_tokens=2,
                              lora_rank=4, lora_alpha=8.0, out_dir=str(tmp_path / "run"), **kw)

    first = distill.run(cfg())
    again = distill.run(cfg(resume=True))
    assert again["accuracy_end"] == first["accuracy_end"]
    assert "distill: reverse KL" in capsys.readouterr().out
    zero = distill.run(dataclass_replace(cfg(), steps=0, out_dir=str(tmp_path / "zero")))
    assert zero["reverse_kl_first"] is None and zero["accuracy_end"] is not None


def dataclass_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


# -- 4. sessions stopped when a recipe crashes -------------------------------------------


def _active(resource, names):
    return {s.session_id for s in resource.list_sessions() if s.state == "active" and s.name in names}


@pytest.mark.parametrize("name,target,names", [
    ("sft", "learning_rate_at", {"sft"}),
    ("rl", "build_samples", {"rl"}),
    ("dpo", "forward_backward_custom", {"dpo", "dpo-ref"}),
    ("distill", "teacher_advantages", {"distill"}),
])
def test_a_crashing_recipe_stops_its_sessions(name, target, names, resource, tiny_model_dir, tmp_path, monkeypatch):
    from together_train_cookbook.rl import train as rl_train
    from together_train_cookbook.supervised import dpo as dpo_loss_module

    mod = RECIPES[name]

    def boom(*a, **k):
        raise RuntimeError("boom")

    # rl: inside the shared RL loop; dpo: inside its loss (supervised/dpo.py)
    monkeypatch.setattr({"rl": rl_train, "dpo": dpo_loss_module}.get(name, mod), target, boom)
    kw = dict(model=str(tiny_model_dir), address=resource.address, steps=2, batch_size=2, eval_examples=2,
              eval_max_tokens=2, lora_rank=4, out_dir=str(tmp_path / "run"))
    if name != "sft":
        kw.update(eval_every=0)
    if name in ("rl", "distill"):
        kw.update(num_samples=2, max_tokens=3)
    if name == "dpo":
        kw.update(rejected="given")
    before = _active(resource, names)
    with pytest.raises(RuntimeError, match="boom"):
        mod.run(mod.Config(**kw))
    assert _active(resource, names) == before


# -- 3 + 5. resource errors at startup: one line naming the flag ------------------------------


def test_unknown_init_checkpoint_is_one_line_naming_the_flag(resource, tiny_model_dir, tmp_path):
    argv = ["--model", str(tiny_model_dir), "--address", resource.address, "--steps", "1", "--batch-size", "2",
            "--eval-examples", "2", "--lora-rank", "4", "--out-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        rl.main(argv + ["--init-from", "together-train://nope/state/x"])
    msg = str(e.value.code)
    assert msg.startswith("rl: --init-from together-train://nope/state/x: checkpoint") and "\n" not in msg
    assert "NOT_FOUND" in msg and f"resource at {resource.address}" in msg


def test_run_dir_checkpoint_elsewhere_says_where_it_lives(resource, tiny_model_dir, tmp_path):
    """A run made with --address keeps its checkpoint on that resource, not in <run dir>/storage:
    the NOT_FOUND names the URI, the run dir, and says to pass --address of the resource that has it."""
    run_dir = tmp_path / "sft"
    run_dir.mkdir()
    uri = "together-train://s-elsewhere/state/sft-step000010-s-elsewh"
    (run_dir / "summary.json").write_text(json.dumps({"state_uri": uri}))
    cfg = _rl_cfg(tiny_model_dir, resource, tmp_path / "run", init_from=str(run_dir))
    with pytest.raises(tt.NotFoundError) as e:
        rl.run(cfg)
    msg = str(e.value)
    assert f"--init-from {run_dir}: checkpoint {uri}" in msg
    assert str(run_dir / "storage") in msg and "pass --address of the resource that has it" in msg


def test_teacher_checkpoint_flag_named(tmp_path):
    with pytest.raises(SystemExit, match="--teacher-checkpoint /nonexistent: not a checkpoint URI"):
        resolve_init_from("/nonexistent", None, "--teacher-checkpoint")
    with pytest.raises(SystemExit) as e:  # checked up front, before the out dir
        distill.main(["--teacher-checkpoint", "/nonexistent", "--out-dir", str(tmp_path / "run")])
    assert "--teacher-checkpoint /nonexistent: not a checkpoint URI" in str(e.value.code)
    assert not (tmp_path / "run").exists()


def test_unreachable_address_is_one_line_naming_the_flag(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tt, "ResourceClient",
                        functools.partial(tt.ResourceClient, retry=tt.RetryPolicy(max_attempts=1)))
    with pytest.raises(SystemExit) as e:
        sft.main(["--model", str(tiny_model_dir), "--address", "127.0.0.1:1", "--steps", "1", "--batch-size", "2",
                  "--eval-examples", "2", "--out-dir", str(tmp_path / "run")])
    msg = str(e.value.code)
    assert msg.startswith("sft: --address 127.0.0.1:1: [UNAVAILABLE]") and "\n" not in msg


def test_not_found_message_for_a_local_resource(tmp_path):
    """Without --address the checkpoint was looked for in this run's local storage: say so."""
    from together_train_cookbook.checkpoint_refs import explain_not_found

    uri = "together-train://s-a/state/x"
    with pytest.raises(tt.NotFoundError) as e:
        with explain_not_found("--init-from", "runs/sft10", uri, None, tmp_path / "out"):
            raise tt.NotFoundError(f"no checkpoint {uri}")
    msg = str(e.value)
    assert f"--init-from runs/sft10: checkpoint {uri} is not on this run's local resource" in msg
    assert str(tmp_path / "out" / "storage") in msg and "runs/sft10/storage" in msg and "--address" in msg
