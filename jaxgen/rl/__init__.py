"""Reinforcement learning from verifiable rewards: rollouts from the live engine, the policy-gradient update
with the training forward, the new weights swapped into the same engine (`rl.py`; docs/rl.md).

    objectives.py   the algorithms as a table (advantages and token loss each), the training forward's token
                    log-probabilities and entropy, the clipped GRPO / REINFORCE loss with a KL penalty
    tasks.py        prompts and rewards: the built-in arithmetic task, JSONL prompt files, "module:function"
    policy.py       what trains and how the engine gets it: the whole model, or LoRA adapters over a
                    frozen base, served from the engine's adapter bank and swapped into its slot in place
    loop.py         the loop: run_rl(cfg, run_dir), one jitted update, checkpoints, metrics, reward.png
"""
