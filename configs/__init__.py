"""Experiment configs: `get_config(arg)` per family, `sweep(add)` beside each."""
