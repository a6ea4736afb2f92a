"""Experiment tooling: sweeps of a config's rows x seeds, their reports and plots.

plan         rows x seeds -> jobs, every check before anything runs
launch       the local launcher (train.py, eval.py subprocesses)
report       collecting jobs, seed statistics, tables, plots
sweep        the command line: python -m rope_jax.experiments.sweep
plot_layout  draws multimodal position layouts: python -m rope_jax.experiments.plot_layout
"""
