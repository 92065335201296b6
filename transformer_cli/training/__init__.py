"""Training: the loop that `tfm train` (classify.py) and `tfm pretrain` (pretrain.py) share, and a run's setup."""
