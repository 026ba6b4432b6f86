"""Reinforcement learning from verifiable rewards: rollouts from the live engine, the policy-gradient update
with the training forward, the new weights swapped into the same engine (`rl.py`; docs/rl.md).

    objectives.py   advantages (group-relative, batch baseline), the training forward's token
                    log-probabilities and entropy, the clipped GRPO / REINFORCE loss with a KL penalty
    tasks.py        prompts and rewards: the built-in arithmetic task, JSONL prompt files, "module:function"
    loop.py         the loop: run_rl(cfg, run_dir), one jitted update, checkpoints, metrics, reward.png
"""
