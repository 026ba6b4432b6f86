"""EAGLE-3 draft heads (jaxgen.model.eagle, jaxgen.training.eagle): the head's training forward equals its
cached drafting steps; a trained head drafts what the target says (a random one does not); speculative
output with the head equals plain decoding token for token; the head's run resumes bitwise."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingConfig
from jaxgen.model import eagle
from jaxgen.model.kvcache import KVCache

CFG = ModelConfig(vocab_size=384, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64)


def _features(params, tokens, positions, head):
    _, _, features = model.hidden_states(params, tokens, positions, cfg=CFG, taps=head.layers)
    return features


def test_training_forward_equals_the_cached_drafting_steps():
    """Step 0 over a sequence is the head's catch-up pass; steps 1 and 2 at row t are its single drafting
    steps after a cache of rows <= t, fed its own hidden state and the next tokens."""
    params = model.init_params(CFG, jax.random.key(0))
    head = eagle.new_head(CFG, jax.random.key(1))
    head = head.replace(params=jax.tree.map(lambda p: p * 8 if p.ndim > 1 else p, head.params))  # far from uniform
    b, t, k = 2, 12, 3
    tokens = jax.random.randint(jax.random.key(2), (b, t), 0, CFG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    features = _features(params, tokens, positions, head)
    trained = eagle.train_forward(head, params["embed_vd"], features, tokens, positions, jnp.ones_like(tokens), k)
    assert trained.shape == (k, b, t, CFG.vocab_size)

    follow = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    hidden = eagle.project(head, features)
    h0, logits0, _ = eagle.step(head, params["embed_vd"], hidden, follow, positions, KVCache.init(head.cfg, b, 32))
    np.testing.assert_allclose(logits0, trained[0], rtol=2e-4, atol=2e-4)

    row = 5  # the head's cache holds rows <= 5 (verified), then drafts on from there
    upto = jnp.where(positions <= row, positions, -1)
    _, _, cache = eagle.step(head, params["embed_vd"], hidden, follow, upto, KVCache.init(head.cfg, b, 32))
    h = h0[:, row : row + 1]
    for j in (1, 2):
        h, logits, cache = eagle.step(head, params["embed_vd"], h, tokens[:, row + j + 1 : row + j + 2],
                                      jnp.full((b, 1), row + j), cache)  # fmt: skip
        np.testing.assert_allclose(logits[:, 0], trained[j][:, row], rtol=2e-4, atol=2e-4)
    assert not np.allclose(trained[1][:, row], trained[0][:, row])  # the steps differ: the check can fail


def test_a_head_that_does_not_fit_is_refused():
    head = eagle.new_head(CFG, jax.random.key(0))
    wider = dataclasses.replace(CFG, d_model=48)
    with pytest.raises(ValueError, match="hidden size 32 vs the target's 48"):
        eagle.check_head(head, wider)
    with pytest.raises(ValueError, match=r"draft\.layers: layer 5 is not allowed: 0\.\.2"):
        eagle.new_head(CFG, jax.random.key(0), (1, 2, 5))


# --- a head trained for a trained tiny model ------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_cfg, tmp_path_factory):
    """configs/tiny.yaml trained for 60 steps: a model whose next tokens depend on the text."""
    from jaxgen.training.trainer import train

    run_dir = tmp_path_factory.mktemp("eagle_target")
    cfg = dataclasses.replace(tiny_cfg, training=dataclasses.replace(tiny_cfg.training, steps=60, eval_every=60))
    train(cfg, run_dir, progress=False)
    return run_dir


def _head_cfg(tiny_cfg, target, steps: int, **draft):
    return dataclasses.replace(
        tiny_cfg,
        training=dataclasses.replace(tiny_cfg.training, steps=steps, eval_every=steps, log_every=50),
        optimizer=dataclasses.replace(tiny_cfg.optimizer, learning_rate=3e-3, warmup_steps=10),
        checkpoint=dataclasses.replace(tiny_cfg.checkpoint, every=steps),
        draft=dataclasses.replace(tiny_cfg.draft, target=str(target), **draft),
    )


@pytest.fixture(scope="module")
def trained_head(tiny_cfg, target, tmp_path_factory):
    from jaxgen.training.eagle import load_head, train_head

    run_dir = tmp_path_factory.mktemp("eagle_head")
    result = train_head(_head_cfg(tiny_cfg, target, 200), run_dir, progress=False)
    return run_dir, result, load_head(run_dir)


def test_a_trained_head_drafts_what_the_target_says_and_a_random_one_does_not(tiny_cfg, target, trained_head):
    """Greedy acceptance estimated on held-out text (metrics.jsonl's tokens_per_step, k = 3 drafts): above 1.6
    tokens per target step for the trained head; a random head's drafts are kept almost never."""
    from jaxgen.inference.loading import load_model
    from jaxgen.training.data.pipeline import PackedSequences, eval_batches
    from jaxgen.training.data.tokens import load_splits
    from jaxgen.training.eagle import evaluate, make_eval

    run_dir, result, head = trained_head
    assert result.status == "finished" and result.step == 200
    trained = result.evals[-1]
    assert trained["tokens_per_step"] > 1.6, trained
    assert trained["accept"][0] > 0.35 and trained["accept"] == sorted(trained["accept"], reverse=True)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["tokens_per_step"] == trained["tokens_per_step"]

    tcfg, tok, params = load_model(target)
    splits = load_splits(tiny_cfg.data, tok)
    held = eval_batches(PackedSequences(splits["eval"]["tokens"], splits["eval"]["flags"], tiny_cfg.data.seq_len), 8, 2)
    fresh = eagle.new_head(tcfg, jax.random.key(7))
    random = evaluate(make_eval(fresh, tcfg, 3), fresh.params, params, held)
    assert random["tokens_per_step"] < 1.1, random
    again = evaluate(make_eval(head, tcfg, 3), head.params, params, held)  # the loaded head is the trained one
    assert again["tokens_per_step"] == pytest.approx(trained["tokens_per_step"], abs=1e-6)


def test_speculative_output_with_the_head_equals_plain_decoding(target, trained_head):
    """Greedy and sampled rows, ragged prompts, rows with 3, 4 and no drafts in one batch: token for token
    what plain decoding gives, with drafts kept (the kept-draft paths ran)."""
    from jaxgen.inference.loading import load_model

    _, _, head = trained_head
    cfg, tok, params = load_model(target)
    plain = Generator(params, cfg, tok, max_batch=4)
    spec = Generator(params, cfg, tok, max_batch=4, draft=head, spec_gate=False)  # every chunk speculates
    prompts = ["def __init__(self", "import os\n", "    return", "class A:\n    "]
    for temperature in (0.0, 0.8):
        settings = [SamplingConfig(max_new_tokens=40, temperature=temperature, seed=i, num_speculative_tokens=n)
                    for i, n in enumerate((3, 4, 0, 4))]  # fmt: skip
        expected = plain.generate(prompts, [dataclasses.replace(s, num_speculative_tokens=0) for s in settings])
        before = dict(spec.speculation)
        got = spec.generate(prompts, settings)
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        assert spec.speculation["accepted"] > before["accepted"]
    stats = spec.speculation_stats()
    assert stats["tokens_per_step"] > 1.3, stats
    assert stats["accepted_at"][0] >= stats["accepted_at"][1] >= stats["accepted_at"][3]


def test_the_vllm_layout_round_trip_and_its_refusals(tmp_path, target, trained_head):
    from jaxgen.hf import eagle3
    from jaxgen.hf.config import HFError
    from jaxgen.inference.loading import load_model

    _, _, head = trained_head
    cfg, tok, _ = load_model(target)
    folder = eagle3.save(tmp_path / "head", head, cfg, tok)
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"]
    assert written["eagle_aux_hidden_state_layer_ids"] == list(head.layers)
    back = eagle3.load(folder, cfg, tok)
    assert back.layers == head.layers
    np.testing.assert_array_equal(back.draft_to_target, head.draft_to_target)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back.params, head.params)

    from jaxgen.config import ServeConfig
    from jaxgen.inference.loading import load_for_serving

    run_dir = trained_head[0]
    for where in (run_dir, folder):  # serve.draft: a head run or a vLLM-layout folder
        loaded = load_for_serving(str(target), ServeConfig(draft=str(where)))
        assert isinstance(loaded.draft, eagle.Head) and loaded.draft.layers == head.layers

    with pytest.raises(HFError, match="hidden_size 64 vs the target's 48"):
        eagle3.load(folder, dataclasses.replace(cfg, d_model=48, num_heads=4), tok)
    data = json.loads((folder / "tokenizer.json").read_text())  # one more token: another tokenizer
    data["added_tokens"].append({**data["added_tokens"][0], "id": 257, "content": "<|extra|>"})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(HFError, match="tokenizer"):
        eagle3.load(folder, cfg, tok)


def test_the_head_run_killed_with_sigkill_resumes_bitwise(tmp_path, target, token_cache):
    """train.py draft.target=... killed with SIGKILL once a checkpoint is complete continues from it to the
    losses and params of a run never killed."""
    import sys

    from jaxgen.training.eagle import load_head
    from tests.test_resume import kill_after_a_checkpoint, run

    def cmd(run_dir, *more):
        return [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "--no-progress",
                f"data.cache_dir={token_cache}", f"draft.target={target}", "training.steps=400", "checkpoint.every=3",
                "training.log_every=1", "training.eval_every=400", *more]  # fmt: skip

    killed, never = tmp_path / "killed", tmp_path / "never"
    saved = kill_after_a_checkpoint(cmd(killed), killed)
    assert f"from step {saved}" in run(cmd(killed, "training.steps_per_run=2")).stdout
    end = saved + 2
    run(cmd(never, f"training.steps_per_run={end}"))

    def losses(run_dir):  # the later record of a step done twice (before the kill and after it)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    assert [losses(killed)[s] for s in range(1, end + 1)] == [losses(never)[s] for s in range(1, end + 1)]
    a, b = (load_head(r, step=end) for r in (killed, never))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.params, b.params)


def test_the_engine_drafts_with_the_head_exactly_under_preemption_with_structured_and_lora_rows(target, trained_head):
    """The serving engine with the head's own page pool on the target's page tables: a pool too small for every
    row (preempted and recomputed), prefix-cache hits, chunked prefill (the pending feature between chunks), a
    structured row (drafts checked against its automaton), and rows with LoRA adapters (the head drafts from
    their features, verification runs their adapter): each output equals the same engine's plain decoding."""
    from jaxgen.config import ServeConfig
    from jaxgen.inference.engine import Engine
    from jaxgen.inference.loading import load_model
    from jaxgen.inference.structured import Structured
    from jaxgen.model import lora

    _, _, head = trained_head
    cfg, tok, params = load_model(target)
    serve = ServeConfig(slots=4, page_size=16, num_pages=14, chunk_steps=8, prefill_chunk=16, max_loras=1,
                        max_lora_rank=4, spec_gate=False)  # fmt: skip
    engine = Engine(params, cfg, tok, serve, draft=head)
    lcfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=4, targets=("q", "v")))
    rng = np.random.default_rng(0)
    adapter = {t: {k: rng.normal(0, 0.2, s.shape).astype(np.float32) for k, s in pair.items()}
               for t, pair in lora.lora_specs(lcfg).items()}  # fmt: skip
    engine.load_lora("a1", adapter, 1.0)
    shared = "import os\nimport sys\nimport json\n\n\ndef main(argv):\n    "  # whole pages shared by later rows
    prompts = [shared + "x = 1", shared + "for i in", "def __init__(self", shared + "return", "class A:\n    ", "# "]
    plain = [SamplingConfig(max_new_tokens=40, temperature=t, seed=i, ignore_eos=True)
             for i, t in enumerate((0.0, 0.8, 0.0, 0.7, 0.0, 1.0))]  # fmt: skip
    plain[5] = dataclasses.replace(plain[5], ignore_eos=False, structured=Structured(regex=r"(yes|no)( [a-z]+){1,6}\."))
    names = [None, "a1", None, None, "a1", None]
    spec = [dataclasses.replace(c, num_speculative_tokens=k) for c, k in zip(plain, (4, 3, 8, 4, 4, 4), strict=True)]
    want = engine.generate(prompts, plain, lora=names)
    got = engine.generate(prompts, spec, lora=names)
    assert [o.tokens for o in got] == [o.tokens for o in want]
    assert want[1].tokens != engine.generate(prompts[1:2], plain[1])[0].tokens  # the adapter matters
    m = engine.metrics()
    assert m["requests_preempted"] > 0 and m["prefix_cache_hit_tokens"] > 0, m
    assert m["spec_accepted_tokens"] > 0 and m["spec_tokens_per_step"] > 1.3, m
    assert engine.pool.in_use() == 0


def test_int8_weights_with_the_head_equal_their_plain_decoding(target, trained_head):
    """int8 target weights (the embedding too: the head embeds through it): speculative output with the head
    equals the same int8 model's plain decoding, greedy and sampled."""
    from jaxgen.inference.loading import load_model
    from jaxgen.model import quant

    _, _, head = trained_head
    cfg, tok, params = load_model(target)
    params = quant.quantize_params(params, embedding=True)
    plain = Generator(params, cfg, tok, max_batch=2)
    spec = Generator(params, cfg, tok, max_batch=2, draft=head, spec_gate=False)
    prompts = ["def __init__(self", "import os\n"]
    settings = [SamplingConfig(max_new_tokens=24, temperature=0.0), SamplingConfig(max_new_tokens=24, temperature=0.8)]
    want = plain.generate(prompts, settings)
    got = spec.generate(prompts, [dataclasses.replace(s, num_speculative_tokens=4) for s in settings])
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert spec.speculation["accepted"] > 0
    # the head int8 too, as serving holds it with serve.quantize=int8 (`loading.load_for_serving`)
    from jaxgen.config import ServeConfig
    from jaxgen.inference.loading import load_for_serving

    served = load_for_serving(target, ServeConfig(quantize="int8", quantize_embedding=True, draft=str(trained_head[0])))
    int8_head = served.draft
    assert quant.is_q(int8_head.params["layer"]["w_q_dnh"]) and not quant.is_q(int8_head.params["fc_fd"])
    spec8 = Generator(served.params, cfg, tok, max_batch=2, draft=int8_head, spec_gate=False)
    got = spec8.generate(prompts, [dataclasses.replace(s, num_speculative_tokens=4) for s in settings])
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert spec8.speculation["accepted"] > 0
