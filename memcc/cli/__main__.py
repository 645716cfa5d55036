"""``python -m memcc.cli``: the ``memcc`` command."""

from memcc.cli import main

main()
