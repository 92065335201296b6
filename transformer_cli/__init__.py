"""tfm: train, evaluate and serve a from-scratch transformer sentiment classifier."""

__version__ = "0.1.0"
