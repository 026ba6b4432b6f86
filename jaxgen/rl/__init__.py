"""Reinforcement learning from verifiable rewards: the policy-gradient objectives over sampled completions.

objectives.py   advantages (group-relative, batch baseline), the training forward's token
                log-probabilities and entropy, the clipped GRPO / REINFORCE loss with a KL penalty
"""
