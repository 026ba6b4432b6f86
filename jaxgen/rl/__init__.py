"""Reinforcement learning from verifiable rewards: rollouts from the live engine, the policy-gradient update
with the training forward, the new weights swapped into the same engine (`rl.py`; docs/rl.md).

    objectives.py   the algorithms as a table (advantages and token loss each), the training forward's token
                    log-probabilities and entropy, the GRPO / REINFORCE loss with a KL penalty and the
                    importance-weight correction of stale rollouts (truncated or masked)
    tasks.py        prompts and rewards: the built-in arithmetic task, JSONL prompt files, "module:function"
    policy.py       what trains and how the engine gets it: the whole model, or LoRA adapters over a
                    frozen base, served from the engine's adapter bank and swapped into its slot in place
    rollouts.py     a step's rollouts: generated, rewarded, each token's policy version, saved when made
                    ahead of their update (rl.max_staleness) so a resumed run takes them back
    environments.py multi-turn tasks: the environment interface (reset, step, reward), the built-in calculator
    episodes.py     chat rollouts: turns on the engine, tool calls parsed, the loss's mask on the model's tokens
    loop.py         the loop: run_rl(cfg, run_dir), one jitted update, checkpoints, metrics, reward.png
"""
