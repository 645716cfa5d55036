"""``python -m memcc``: the ``memcc`` command (where the console script is not on PATH)."""

from memcc.cli import main

main()
