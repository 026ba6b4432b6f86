"""Multi-turn rollouts with a tool (jaxgen.rl.environments, jaxgen.rl.episodes): the calculator environment and
its safe evaluator; an episode's tokens and loss mask equal what chat SFT renders and marks for the same
conversation (the mask covers exactly the model's turns); and GRPO with the calculator raises the reward on sums
the policy cannot do in its head, while with the tool disabled it does not."""

import concurrent.futures

import numpy as np
import pytest

from jaxgen.config import ConfigError, RLConfig, load_config
from jaxgen.rl import environments, episodes, loop
from jaxgen.rl.environments import DISABLED, Calculator, evaluate
from jaxgen.training.metrics import read_metrics
from tests.conftest import ROOT

# configs/rl-calculator.yaml with fewer RL steps: its warm start (300 steps) calls in about half its episodes,
# 0.4-0.7 of the calls right; GRPO then makes calling the rule
SMALL = [
    "training.steps=24", "checkpoint.every=24", "mesh.data=1",
]  # fmt: skip


def config(token_cache, *overrides):
    return load_config(ROOT / "configs" / "rl-calculator.yaml", [*SMALL, f"data.cache_dir={token_cache}", *overrides])


@pytest.fixture(scope="module")
def warm(tmp_path_factory, token_cache):
    """The calculator task's warm-started policy (chat SFT on its conversations), shared as rl.init_from."""
    from jaxgen.training.trainer import train

    folder = tmp_path_factory.mktemp("calculator") / "warm_start"
    train(loop.warm_start_config(config(token_cache), folder), folder, progress=False)
    return folder


@pytest.fixture(scope="module")
def llm(warm):
    from jaxgen.inference.llm import LLM

    return LLM(warm, slots=64, num_pages=64 * 12, max_logprobs=0)


def run(token_cache, warm, folder, *overrides):
    cfg = config(token_cache, f"rl.init_from={warm}", *overrides)
    assert loop.run_rl(cfg, folder, progress=False).status == "finished"
    return [r for r in read_metrics(folder) if "reward" in r]


def test_the_calculator_evaluates_integer_sums_and_runs_no_code():
    assert evaluate("347+598") == 945 and evaluate("(2+3)*4-1") == 19 and evaluate("7//2") == 3
    for bad in ("__import__('os').system('true')", "2**100", "1.5+1", "x+1", "1/2", "", None, "9" * 300):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_the_calculator_evaluates_from_many_threads_at_once():
    """The reward workers step environments in threads; CPython 3.11's ast.parse raised SystemError then."""
    expression = "((1+2)*(3-4))//(5+(6*7))-(8+9)"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = set(pool.map(lambda _: evaluate(expression), range(20000)))
    assert got == {((1 + 2) * (3 - 4)) // (5 + (6 * 7)) - (8 + 9)}


def test_the_calculator_environment_answers_calls_and_rewards_the_last_message():
    env = Calculator({"prompt": "347+598", "answer": "945"})
    assert env.reset() == [{"role": "user", "content": "347+598"}]
    function = {"name": "calculator", "arguments": {"expression": "347+598"}}
    call = {"id": "call_0", "type": "function", "function": function}
    assert env.step({"role": "assistant", "content": None, "tool_calls": [call]}) == [
        {"role": "tool", "tool_call_id": "call_0", "content": "945"}
    ]
    wrong = {**call, "function": {"name": "search", "arguments": {}}}
    (answer,) = env.step({"role": "assistant", "content": None, "tool_calls": [wrong]})
    assert "no tool named 'search'" in answer["content"]
    assert env.step({"role": "assistant", "content": "945"}) == [] and env.reward() == 1.0
    off = Calculator({"prompt": "347+598", "answer": "945"}, tools=False)
    off.reset()
    assert off.step({"role": "assistant", "content": None, "tool_calls": [call]})[0]["content"] == DISABLED
    assert off.step({"role": "assistant", "content": "944"}) == [] and off.reward() == 0.0
    # the warm start's share of calls is a coin apart from the sum (not a function of the operands)
    convs = Calculator.warm_start(0, 4000)
    used = np.asarray([len(c["messages"]) > 2 for c in convs])
    assert abs(used.mean() - Calculator.TOOL_SHARE) < 0.03
    big = np.asarray([eval(c["messages"][0]["content"]) >= 1000 for c in convs])  # the sum of two numbers
    assert abs(used[big].mean() - used[~big].mean()) < 0.05


def test_an_environment_is_named_as_module_and_class_and_refused_with_the_reason():
    jsonl = {"task": "jsonl", "prompts": ("p.jsonl",), "init_from": "runs/x"}
    cfg = RLConfig(**jsonl, environment="jaxgen.rl.environments:Calculator")
    assert environments.environment_class(cfg) is Calculator
    assert environments.environment_class(RLConfig(task="calculator")) is Calculator
    assert environments.environment_class(RLConfig()) is None  # arithmetic: single turn, a reward function
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        environments.environment_class(RLConfig(**jsonl, environment="no_such_module:Env"))
    with pytest.raises(ValueError, match="has no class 'evaluate'"):
        environments.environment_class(RLConfig(**jsonl, environment="jaxgen.rl.environments:evaluate"))
    with pytest.raises(ValueError, match="has no reset, step, reward"):
        environments.environment_class(RLConfig(**jsonl, environment="collections:OrderedDict"))
    with pytest.raises(ConfigError, match=r"rl\.environment.*only with rl\.task=jsonl"):
        RLConfig(environment="jaxgen.rl.environments:Calculator")
    with pytest.raises(ConfigError, match=r"rl\.max_turns"):
        RLConfig(task="calculator", max_turns=0)
    with pytest.raises(ConfigError, match=r"rl\.reward=.*empty with an environment"):
        RLConfig(task="calculator", reward="mytask:reward")


def test_an_episodes_tokens_and_mask_are_what_chat_sft_renders_and_marks_for_its_conversation(llm):
    """The mask covers exactly the model's turns: the tokens of each finished episode equal the chat template's
    render of its conversation (the model's messages as the text it wrote) tokenized whole, and the trained
    tokens equal chat SFT's assistant mask of that render (an independent computation: spans of the render,
    not the order tokens were appended in); the batch puts them where the forward scores them."""
    from jaxgen.rl.rollouts import episode_batch
    from jaxgen.training.data.chat import ChatRenderer, Conversation, encode_rendered

    cfg = RLConfig(task="calculator", max_turns=2, max_prompt_tokens=32, max_new_tokens=128, group_size=8,
                   prompts_per_step=8)  # fmt: skip
    envs = [Calculator(r) for r in Calculator.records(3, 64)]
    seeds = np.random.default_rng(0).integers(0, 2**62, size=(2, 64))
    with concurrent.futures.ThreadPoolExecutor(2) as workers:
        done = episodes.run_episodes(llm, episodes.Chat(llm.tokenizer), envs, seeds, cfg, workers)
    renderer = ChatRenderer(llm.tokenizer.chat_template)
    checked = {0: 0, 1: 0}  # episodes without and with a tool call
    for e in done:
        assert e.end in episodes.ENDS and len(e.tokens) <= 160
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.model, strict=True) if not m)
        assert all(lp <= 0.0 for lp, m in zip(e.logprobs, e.model, strict=True) if m)
        if e.end == "length":  # its last turn was cut: no end-of-turn token that a render would write
            continue
        said = iter(e.said)
        written = [{"role": "assistant", "content": next(said)} if m["role"] == "assistant" else m for m in e.messages]
        conv = Conversation(written, None, "episode")
        ((tokens, trained),) = encode_rendered([(conv, *renderer.spans(conv))], llm.tokenizer)
        assert e.tokens == tokens.tolist()
        assert e.model == trained.tolist()
        checked[min(e.tool_calls, 1)] += 1
    assert checked[0] >= 10 and checked[1] >= 5, checked  # both kinds of episode were compared
    rewards = np.asarray([e.env.reward() for e in done], np.float32).reshape(8, 8)
    batch = episode_batch(load_config(ROOT / "configs" / "rl-calculator.yaml"), done, rewards)
    for i, e in enumerate(done):
        n = len(e.tokens)
        np.testing.assert_array_equal(batch["tokens"][i, :n], e.tokens)
        np.testing.assert_array_equal(batch["mask"][i, : n - 1], np.asarray(e.model[1:], np.float32))
        np.testing.assert_array_equal(batch["old_logp"][i, : n - 1], np.asarray(e.logprobs[1:], np.float32))
        assert batch["mask"][i, n - 1 :].sum() == 0 and (batch["positions"][i, n:] == -1).all()


class Broken(Calculator):
    def step(self, message):
        return "945"


class Failing(Calculator):
    def step(self, message):
        raise KeyError("expression")


class NoOpening(Calculator):
    def reset(self):
        raise OSError("no such task")


@pytest.mark.parametrize("env, error", [(Broken, r"Broken\.step returned '945'"),
                                        (Failing, r"Failing\.step raised KeyError: 'expression'"),
                                        (NoOpening, r"NoOpening\.reset raised OSError: no such task")])  # fmt: skip
def test_an_environment_that_fails_or_returns_no_messages_is_named(llm, env, error):
    cfg = RLConfig(task="calculator", max_turns=2, max_prompt_tokens=32, max_new_tokens=128)
    with concurrent.futures.ThreadPoolExecutor(1) as workers, pytest.raises(ValueError, match=error):
        episodes.run_episodes(llm, episodes.Chat(llm.tokenizer), [env({"prompt": "100+200", "answer": "300"})],
                              np.zeros((2, 1), np.int64), cfg, workers)  # fmt: skip


def test_an_opening_longer_than_the_prompt_budget_is_refused_before_any_rollout(tmp_path, token_cache, warm):
    cfg = config(token_cache, f"rl.init_from={warm}", "rl.max_prompt_tokens=16")
    with pytest.raises(ValueError, match=r"prompt 0 \('\d+\+\d+'...\) has 31 tokens; rl.max_prompt_tokens=16"):
        loop.run_rl(cfg, tmp_path / "run", progress=False)
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_grpo_with_the_calculator_raises_the_reward_and_with_the_tool_disabled_does_not(tmp_path, token_cache, warm):
    """The same warm start, the same prompts and seeds: with the tool, GRPO turns the warm start's occasional
    call into the rule and the reward follows; with every call answered by an error, no rollout is right to
    learn from, and the reward stays at the policy's (near zero) mental arithmetic."""
    on = run(token_cache, warm, tmp_path / "tools")
    off = run(token_cache, warm, tmp_path / "no-tools", "rl.tools=false", "training.steps=12")
    reward, calls = np.asarray([r["reward"] for r in on]), np.asarray([r["tool_calls"] for r in on])
    assert calls[-4:].mean() > max(0.85, calls[:4].mean() + 0.25), calls  # calling became the rule
    assert reward[-6:].mean() > reward[:4].mean() + 0.2, reward  # seen: +0.32 to +0.57 over three warm starts
    rewards_off = [r["reward"] for r in off]  # seen over 40 steps: mean 0.007, at most 4 of 64 right in a step
    assert np.mean(rewards_off) < 0.05 and max(rewards_off) < 0.15, rewards_off
    assert all(r["end_done"] + r["end_turns"] + r["end_length"] == pytest.approx(1.0) for r in on + off)


def test_a_chat_template_that_refuses_an_episodes_messages_or_has_none_is_named():
    from jaxgen.tokenizer import Tokenizer

    byte = Tokenizer.byte_level()
    with pytest.raises(ValueError, match="multi-turn rollouts need a chat template"):
        episodes.Chat(byte)
    strict = Tokenizer(byte.tok, chat_template="{% if messages[-1].role == 'tool' %}{{ raise_exception('no tools') }}"
                       "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")  # fmt: skip
    chat = episodes.Chat(strict)
    assert chat.opening([{"role": "user", "content": "1+2"}], None) == byte.encode("1+2")
    with pytest.raises(ValueError, match=r"refused an episode's messages \(roles \['user', 'tool'\]\): no tools"):
        chat.opening([{"role": "user", "content": "1+2"}, {"role": "tool", "content": "3"}], None)
    # a model's text whose call the JSON parser cannot hold is text, not a crash
    huge = '<tool_call>\n{"name": "calculator", "arguments": {"x": ' + "9" * 5000 + "}}\n</tool_call>"
    assert chat.message(huge) == {"role": "assistant", "content": huge}


def test_what_a_template_writes_after_the_end_of_turn_token_is_appended_with_the_next_messages():
    """ChatML-like templates write a newline after the end-of-turn token the model stops on: it is in neither
    the sampled tokens nor the next messages' render, and belongs to the tokens appended, so the episode's
    tokens are the whole conversation's render."""
    from jaxgen.tokenizer import Tokenizer

    byte = Tokenizer.byte_level()
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|endoftext|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
    chat = episodes.Chat(Tokenizer(byte.tok, chat_template=template))
    user, model, tool = ({"role": r, "content": c} for r, c in (("user", "1+2"), ("assistant", "x"), ("tool", "3")))
    sampled = [*byte.encode("x"), byte.eos_id]  # what the model wrote, its end-of-turn token last
    tokens = chat.opening([user], None) + sampled + chat.following([user, model], [tool], None, byte.eos_id)
    assert byte.decode(tokens) == chat.render([user, model, tool], None, True)
    assert byte.decode(chat.following([user, model], [tool], None, byte.eos_id)).startswith("\n<|tool|>")
