"""The small recipe the tests are written for, spelled out as flags.

``pretrain_gpt.py`` takes Megatron-LM's defaults (dropout 0.1, Adam beta2 0.999, min lr 0, a log line every 100
iterations, no evaluation without --eval-interval), as a Megatron user expects. Tests that compare layouts
(dropout would draw other masks at another layout), read per-iteration log lines or count evaluations put
these flags first; their own flags come later and override them.
"""
RECIPE = ("--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--adam-beta2", "0.95", "--min-lr", "3e-4",
          "--log-interval", "10", "--eval-interval", "1000")
