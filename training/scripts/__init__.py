"""Training-area tools, run from the repository root as `python -m training.scripts.NAME`."""
