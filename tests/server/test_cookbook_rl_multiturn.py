"""A multi-turn task trained by the shared RL loop: the two-turn arithmetic dialogue
(`envs.arithmetic_dialogue`: turn 2 is judged against the model's own turn-1 answer) on a tiny
model, 24 steps of 8 dialogues x 4 episodes; the mean episode return must rise by more than 4
standard errors.

The model: a tiny random Llama (hidden 64, 2 layers) over a 35-token character vocabulary with a
ChatML template, built here. Over SmolLM2's 49152 tokens a tiny random model cannot learn a reward
in a CI budget: with tied embeddings of std 0.02 and a final RMSNorm (|h| = 8) no logit moves by
more than ~1.3, so no token gets more than ~e^2.6 times its uniform 1/49152, and a class of tokens
(the digits) gains even less. Over 35 characters, with embeddings of std 0.06 (|logit| <= ~3.8),
the digits can become most of the mass. Measured (this seed, lr 1e-2): per-step mean return 0.17
at step 0, ~0.8 by step 20 (std 0.06: 0.00 -> 1.0 in 4 steps, from a start that rarely writes a
digit; std 0.02: 0.31 -> ~0.5, the digits cannot gain enough).

Reward per turn: 1 for the right number, ``format_reward`` 0.5 for a wrong bare number, 0 for
anything else (one sampled token per turn); most of the rise is the format (a bare number in both
turns), which both turns' actions must learn. The rise is measured, not assumed: the returns of
the first 6 and last 6 steps (6 x 32 episodes each) are compared with a two-sample z statistic
whose standard error comes from the episodes' own variance (each step logs ``reward`` and
``reward_std`` over its 32 episodes; the pooled variance of a window is mean(std²) + var(means),
which also counts the drift inside a window, so it errs high). Without learning z ~ N(0, 1):
z > 4 by luck has probability 3e-5.
"""

from __future__ import annotations

import json
import math

import pytest

from together_train_cookbook.envs import arithmetic_dialogue
from together_train_cookbook.rl import ChatEnv, RolloutEvaluator, SamplingSettings
from together_train_cookbook.recipes import rl as rl_recipe
from together_train_cookbook.tokenizer import load_codec

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHARS = "0123456789 +?.\nWhat is Add to your answer user assistant system"


def build_char_model(out):
    """A tiny random Llama over one token per character of `CHARS` (+ ChatML specials)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one piece per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    eos = vocab["<|im_end|>"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=eos, pad_token_id=vocab["<|endoftext|>"]))
    with torch.no_grad():  # tied input/output embeddings of std 0.06, not 0.02: see the module docstring
        model.get_input_embeddings().weight.mul_(3.0)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=vocab["<|endoftext|>"])
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def char_resource(tmp_path_factory):
    import together_train as tt

    model = build_char_model(tmp_path_factory.mktemp("char-llama"))
    with tt.launch_local(model=str(model), generators=1, storage_dir=tmp_path_factory.mktemp("storage-char"),
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1"]) as c:
        yield model, c


def test_dialogue_env_judges_turn_two_by_the_models_own_first_answer(tmp_path):
    codec = load_codec(str(build_char_model(tmp_path / "m")))
    env = arithmetic_dialogue.ArithmeticDialogue(codec, 3, 4, 2, format_reward=0.5)
    assert isinstance(env, ChatEnv)
    obs = env.initial_observation()
    wrong = codec.tokenizer.encode("8") + [codec.stop_token_ids[0]]
    s1 = env.step(wrong)  # a wrong bare number: format reward, the dialogue goes on
    assert (s1.reward, s1.episode_done, s1.metrics) == (0.5, False, {"turn1_correct": 0.0})
    assert s1.next_observation[:len(obs) + len(wrong)] == obs + wrong  # the env's reply extends the context
    assert codec.tokenizer.decode(s1.next_observation).endswith("Add 2 to your answer.<|im_end|>\n<|im_start|>assistant\n")
    s2 = env.step(codec.tokenizer.encode("10"))  # 8 + 2: right given its own first answer
    assert (s2.reward, s2.episode_done) == (1.0, True)
    assert s2.metrics == {"turn2_correct": 1.0, "correct": 0.0}


def test_multi_turn_env_learns(char_resource, tmp_path):
    model, client = char_resource
    codec = load_codec(str(model))
    steps, window, batch, group = 24, 6, 8, 4
    cfg = rl_recipe.Config(model=str(model), steps=steps, batch_size=batch, num_samples=group, max_tokens=1,
                           learning_rate=1e-2, lora_rank=8, lora_alpha=16.0, eval_every=0, save_every=0,
                           out_dir=str(tmp_path / "run"))
    data = arithmetic_dialogue.dataset(codec, batch, group, seed=0, max_operand=3, format_reward=0.5)
    evaluator = RolloutEvaluator(arithmetic_dialogue.held_out(codec, 16, max_operand=3),
                                 SamplingSettings(1, 1.0, codec.stop_token_ids, codec.stop_strings))
    summary = rl_recipe.run(cfg, client=client, dataset=data, evaluator=evaluator)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["step"] >= 0]
    assert [r["step"] for r in recs] == list(range(steps))
    assert all(r["turns"] == 2.0 and r["trained_samples"] > 0 for r in recs[:3]), recs[:3]

    def window_stats(rs):
        means = [r["reward"] for r in rs]
        m = sum(means) / len(means)
        var = sum(r["reward_std"] ** 2 for r in rs) / len(rs) + sum((x - m) ** 2 for x in means) / len(means)
        return m, var, len(rs) * batch * group

    m0, v0, n0 = window_stats(recs[:window])
    m1, v1, n1 = window_stats(recs[-window:])
    z = (m1 - m0) / math.sqrt(v0 / n0 + v1 / n1)
    print(f"multi-turn learning: reward {m0:.3f} (first {window} steps) -> {m1:.3f} (last {window}); "
          f"se {math.sqrt(v0 / n0 + v1 / n1):.3f}; z {z:.1f}; eval {summary['eval_start']} -> {summary['eval_end']}; "
          f"loop {summary['seconds']['loop']:.0f}s")
    assert z > 4, (m0, m1, z)


def test_readme_example_task_runs_multi_turn_through_the_loop(resource, tiny_model_dir, tmp_path):
    """`examples/guess_number.py` (the README's new-task example) with the recipe's own loop: the
    tiny random model never writes the number, so every episode takes all 3 turns."""
    from together_train_cookbook.examples.guess_number import GuessNumber
    from together_train_cookbook.rl import SeededEnvDataset

    codec = load_codec(str(tiny_model_dir))
    cfg = rl_recipe.Config(model=str(tiny_model_dir), address=resource.address, steps=2, batch_size=2, num_samples=2,
                           max_tokens=3, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, save_every=0,
                           out_dir=str(tmp_path / "run"))
    s = rl_recipe.run(cfg, dataset=SeededEnvDataset(lambda rng: GuessNumber(codec, rng), 2, 2, seed=0))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1] and all(r["turns"] == 3.0 for r in recs), recs
    assert all(r["env/correct"] == 0.0 for r in recs) and s["state_uri"]
    # turns 2 and 3 resend the conversation: the generator serves its start from the prefix cache
    assert all(0 < r["prompt_cache_hit_rate"] < 1 for r in recs), [r["prompt_cache_hit_rate"] for r in recs]
