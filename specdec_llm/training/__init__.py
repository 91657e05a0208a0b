"""Building drafts from a target, and measuring them: the CLI's ``distill``, ``corpus`` and
``eval-pair`` use it, the engine never does.

- ``distill``: a draft of target layers (data phase, then divergence training);
- ``eagle``: a feature-level EAGLE draft trained on a token corpus;
- ``loop``: the one training loop both run (resume, checkpoints, deadline);
- ``corpus``: the on-policy corpus (the target's own answers, only ever grown);
- ``evaluate``: a pair's greedy acceptance over a prompt set (``eval-pair``).
"""
