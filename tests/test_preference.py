"""Preference tuning (issue 47): DPO, IPO and SimPO equal TRL's losses and gradients on the same model and
pairs; preference data's bad lines are named and counted; a DPO run learns to prefer the right answer (and,
with chosen and rejected swapped, the wrong one); a killed run resumes bitwise."""

import dataclasses
import json
import types

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxgen import hf
from jaxgen.config import ConfigError, load_config
from jaxgen.tokenizer import Tokenizer
from jaxgen.training import preference
from jaxgen.training.data.pipeline import PreferencePairs
from jaxgen.training.data.preference import PreferenceDataError, encode_pairs
from jaxgen.training.data.tokens import DOC_START, NO_LOSS
from tests.test_hf import SMALL, _one_device, _randomise
from tests.test_resume import kill_after_a_checkpoint, records, run, train_cmd

T, P = 32, 5  # tokens per row (several pairs packed in each), pairs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the transformers model, jaxgen's model config, jaxgen's params of the same weights)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomise(ref, seed=7)
    ref.eval()
    folder = tmp_path_factory.mktemp("pref_llama")
    ref.save_pretrained(folder)
    Tokenizer.byte_level().save_folder(folder)
    cfg, _, params = hf.load_pretrained(folder, mesh=_one_device())
    return ref, cfg, params


def _pairs(rng) -> tuple[np.ndarray, np.ndarray]:
    """A store's tokens and flags: P pairs, each a prompt then a chosen answer, the same prompt then a rejected."""
    tokens, flags = [], []
    for _ in range(P):
        prompt = rng.integers(1, 256, rng.integers(2, 5)).tolist()
        for _ in ("chosen", "rejected"):
            answer = rng.integers(1, 256, rng.integers(1, 7)).tolist()
            f = [NO_LOSS] * len(prompt) + [0] * len(answer)
            f[0] |= DOC_START
            tokens += prompt + answer
            flags += f
    return np.asarray(tokens), np.asarray(flags, np.uint8)


def _config(objective: str, beta: float, smoothing: float, gamma: float, model_cfg):
    overrides = ["data.source=preference", "data.paths=[x.jsonl]", f"training.objective={objective}",
                 f"preference.beta={beta}", f"preference.label_smoothing={smoothing}",
                 f"preference.simpo_gamma={gamma}", f"data.seq_len={T}"]  # fmt: skip
    return dataclasses.replace(load_config(None, overrides), model=model_cfg)


def _trl(objective, beta, smoothing, gamma, chosen, rejected, ref, counts):
    """TRL 1.16's loss of the summed log-probabilities (P,) of chosen and rejected answers: DPO's sigmoid with
    conservative label smoothing and SimPO as TRL's CPO trainer writes them, IPO as its DPO trainer does."""
    from trl.experimental.cpo import CPOTrainer

    kind = {"dpo": "sigmoid", "ipo": "ipo", "simpo": "simpo"}[objective]
    me = types.SimpleNamespace(alpha=0.0, loss_type=kind, beta=beta, label_smoothing=smoothing, simpo_gamma=gamma,
                               accelerator=types.SimpleNamespace(device="cpu"))  # fmt: skip
    if objective == "dpo":
        args = chosen - ref[:, 0], rejected - ref[:, 1]
    elif objective == "ipo":  # TRL's DPO: (c - c0) / nc - (r - r0) / nr, then (delta - 1 / (2 beta))^2
        args = (chosen - ref[:, 0]) / counts[:, 0], (rejected - ref[:, 1]) / counts[:, 1]
    else:
        args = chosen / counts[:, 0], rejected / counts[:, 1]
    losses, _, _ = CPOTrainer.cpo_loss(me, *args)
    return losses.mean()


CASES = [("dpo", 0.1, 0.0, 0.0), ("dpo", 0.5, 0.2, 0.0), ("ipo", 0.1, 0.0, 0.0), ("simpo", 2.5, 0.1, 1.0)]


@pytest.mark.parametrize("objective, beta, smoothing, gamma", CASES)
def test_loss_and_gradients_equal_trls(llama, objective, beta, smoothing, gamma):
    """On one Llama model (transformers' and jaxgen's, the same weights), the same pairs and settings: the loss
    and the gradient of the embedding table (so every layer's backward) within 1e-5 (relative to the largest
    entry where it passes 1). jaxgen packs the pairs several to a row (each answer its own segment); TRL scores
    each sequence alone with its `get_batch_logps` (shifted labels, -100 outside the answer)."""
    from trl.experimental.cpo import CPOTrainer

    ref_model, model_cfg, params = llama
    rng = np.random.default_rng(len(objective) + int(beta * 10))
    tokens, flags = _pairs(rng)
    source = PreferencePairs(tokens, flags, T)
    assert len(source) < P and source.cut == 0  # packed: fewer rows than pairs, nothing cut
    reference = rng.normal(-20, 3, (P, 2)).astype(np.float32)
    source.set_reference(reference)
    batch = {k: np.stack([source[i][k] for i in range(len(source))]) for k in source[0]}
    cfg = _config(objective, beta, smoothing, gamma, model_cfg)
    (loss, _), grads = jax.value_and_grad(preference.preference_loss, has_aux=True)(params, batch, cfg)

    window, labels = np.zeros((2 * P, T + 1), np.int64), np.full((2 * P, T + 1), -100)
    for side in (0, 1):  # TRL's order: every chosen, then every rejected
        for k in range(P):
            lo, hi = source.spans[k, side]
            window[side * P + k, : hi - lo] = tokens[lo:hi]
            trained = (flags[lo:hi] & NO_LOSS) == 0
            labels[side * P + k, : hi - lo] = np.where(trained, tokens[lo:hi], -100)
    ref_model.zero_grad()
    logits = ref_model(torch.tensor(window)).logits.float()
    logps = CPOTrainer.get_batch_logps(logits, torch.tensor(labels), average_log_prob=False)
    counts = torch.tensor((labels[:, 1:] != -100).sum(-1).reshape(2, P).T, dtype=torch.float32)
    want = _trl(objective, beta, smoothing, gamma, logps[:P], logps[P:], torch.tensor(reference), counts)
    want.backward()
    assert abs(float(loss) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (float(loss), float(want))
    embed = ref_model.model.embed_tokens.weight.grad.numpy()  # (IPO's squared loss makes gradients of ~10)
    np.testing.assert_allclose(np.asarray(grads["embed_vd"]), embed, atol=1e-5 * max(1.0, np.abs(embed).max()))
    assert np.abs(embed).max() > 1e-3  # the gradient compared is not vanishingly small


def test_pairs_pack_whole_and_a_pair_too_long_keeps_half_of_each_answer():
    """Rows hold whole pairs in store order; the `answer` ids mark each packed answer's trained targets; a pair
    longer than T + 1 tokens keeps the first (T + 1) // 2 tokens of each of its two answers."""
    tokens = np.arange(1, 61)
    lengths = [6, 5, 4, 7, 20, 30]  # pairs of 11, 11 and 50 tokens
    flags = np.zeros(60, np.uint8)
    flags[np.cumsum([0, *lengths[:-1]])] = DOC_START
    flags[np.cumsum([0, *lengths[:-1]])] |= NO_LOSS  # each answer's first token is its prompt
    source = PreferencePairs(tokens, flags, 23)  # T + 1 = 24 tokens a row
    assert [list(source.pairs_of(r)) for r in range(len(source))] == [[0, 1], [2]] and source.width == 2
    assert source.cut == 1 and [hi - lo for lo, hi in source.spans[2]] == [12, 12]
    row = source.rows(0)
    assert [int(np.sum(row["answer"] == a)) for a in range(4)] == [5, 4, 3, 6] and row["pairs"].tolist() == [1, 1]
    assert row["positions"][:12].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0]  # each answer from 0


def test_objectives_are_the_configs_names():
    """training.objective allows sft and exactly the objectives' table."""
    from jaxgen.config.base import literal_fields
    from jaxgen.config.train import TrainingConfig

    assert set(literal_fields(TrainingConfig)["objective"]) == {"sft", *preference.OBJECTIVES}
    with pytest.raises(ConfigError, match=r"training\.objective='dpo' is not allowed"):
        load_config(None, ["training.objective=dpo"])  # pairs needed
    with pytest.raises(ConfigError, match=r"preference\.label_smoothing"):
        load_config(None, ["preference.label_smoothing=0.5"])


def test_bad_lines_are_named_counted_and_skipped_and_all_bad_stops(tmp_path):
    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    lines = [json.dumps(good), "{not json", json.dumps({"prompt": "1+1=", "chosen": "2"}),
             json.dumps({"prompt": "", "chosen": "2", "rejected": "3"}), json.dumps([1, 2]),
             json.dumps({"prompt": "x", "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"}),
             json.dumps(good | {"chosen": "\ud800"}), json.dumps(good)]  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    data = encode_pairs(Tokenizer.byte_level(), [path])
    assert len(data.pairs) == 2 and len(data.bad) == 6
    where = [b.split(": ")[0] for b in data.bad]
    assert where == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7)]
    assert "rejected: missing" in data.bad[1] and "prompt: missing" in data.bad[2]
    assert "need a conversational prompt" in data.bad[4] and "not valid Unicode" in data.bad[5]
    (chosen, c_mask), (rejected, r_mask) = data.pairs[0]
    assert bytes(chosen[c_mask][:-1].astype(np.uint8)) == b"2" and chosen[-1] == Tokenizer.byte_level().eos_id
    assert bytes(chosen[~c_mask].astype(np.uint8)) == b"1+1=" and bytes(rejected[r_mask][:-1].astype(np.uint8)) == b"3"
    path.write_text("\n".join(lines[1:-1]) + "\n")
    with pytest.raises(PreferenceDataError, match=r"no good preference pair .* 6 bad: .*pairs.jsonl:1: not JSON"):
        encode_pairs(Tokenizer.byte_level(), [path])


def test_conversational_pairs_train_only_the_answers_turn(tmp_path):
    """With a chat template (byte-chat), a pair's trained tokens are its answer's turn: not the prompt's
    messages, an earlier assistant turn in the prompt included."""
    tok = Tokenizer.from_name("byte-chat")
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "EARLIER"},
              {"role": "user", "content": "2+2?"}]  # fmt: skip
    line = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "four"}], "rejected": "five"}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (chosen, c_mask), (rejected, r_mask) = encode_pairs(tok, [path]).pairs[0]
    for tokens, mask, answer in ((chosen, c_mask, "four"), (rejected, r_mask, "five")):
        trained = tok.decode(tokens[mask].tolist())
        assert answer in trained and "EARLIER" not in trained and "2+2?" not in trained
        assert answer not in tok.decode(tokens[~mask].tolist())


def _sums(path, swapped: bool, n: int = 240):
    """Pairs of the right sum and a wrong one (off by 1 or 2), operands 0-3: sixteen facts a tiny model
    learns in a few dozen steps."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.integers(0, 4, 2)
            right, wrong = str(a + b), str(a + b + rng.choice([-2, -1, 1, 2]))
            chosen, rejected = (wrong, right) if swapped else (right, wrong)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": chosen, "rejected": rejected}) + "\n")


PREF = ["data.source=preference", "training.objective=dpo", "data.seq_len=16", "data.eval_fraction=0.25",
        "data.eval_batches=4", "optimizer.learning_rate=3e-3", "preference.beta=0.5"]  # fmt: skip


def test_dpo_learns_to_prefer_the_right_sum_and_swapped_the_wrong_one(tmp_path, token_cache):
    """The right sum chosen over a wrong one: held-out accuracy (pairs whose chosen answer gains the larger
    reward; at the start every reward is 0) ends above 3/4 (measured: 0.97 at 20 steps); with chosen and rejected
    swapped the run learns the swapped preference as well: it prefers the wrong sums."""
    finals = {}
    for swapped in (False, True):
        data = tmp_path / f"sums-{swapped}.jsonl"
        _sums(data, swapped)
        out = run(train_cmd(tmp_path / f"run-{swapped}", token_cache, *PREF, f"data.paths=[{data}]",
                            "training.steps=30", "training.eval_every=30"))  # fmt: skip
        assert "held-out dpo loss" in out.stdout
        evals = [r for r in records(tmp_path / f"run-{swapped}") if "eval_accuracy" in r]
        finals[swapped] = evals[-1]["eval_accuracy"]
    assert finals[False] > 0.75 and finals[True] > 0.75, finals


def test_a_preference_run_killed_with_sigkill_resumes_bitwise(tmp_path, token_cache):
    """A LoRA DPO run killed with SIGKILL continues from its last checkpoint (the reference read back from the
    data's cache, not scored again) to the losses, batches and adapters of a run never killed."""
    from jaxgen.inference.loading import load_lora_run
    from tests.test_resume import make_mesh_one

    data = tmp_path / "sums.jsonl"
    _sums(data, swapped=False)
    cache = tmp_path / "cache"  # this test's own: its reference file alone in it
    args = [*PREF, f"data.paths=[{data}]", "model.lora.rank=4", "training.steps=400", "checkpoint.every=3",
            f"data.cache_dir={cache}"]  # fmt: skip
    killed, never = tmp_path / "killed", tmp_path / "never"
    saved = kill_after_a_checkpoint(train_cmd(killed, token_cache, *args), killed)
    [reference] = cache.glob("*/reference-*.npz")
    scored = reference.stat().st_mtime_ns
    cont = run(train_cmd(killed, token_cache, *args, "training.steps_per_run=2"))
    assert f"from step {saved}" in cont.stdout
    assert reference.stat().st_mtime_ns == scored  # read back from the data's cache, not scored again
    end = saved + 2
    run(train_cmd(never, token_cache, *args, f"training.steps_per_run={end}"))

    def train_records(run_dir):
        return {r["step"]: (r["loss"], r["data"], r["margin"]) for r in records(run_dir) if "data" in r}

    assert [train_records(killed)[s] for s in range(1, end + 1)] == [train_records(never)[s] for s in range(1, end + 1)]
    a, b = (load_lora_run(r, mesh=make_mesh_one(), step=end) for r in (killed, never))
    for x, y in zip(jax.tree.leaves(a[3]), jax.tree.leaves(b[3]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
