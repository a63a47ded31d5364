"""``python -m coordinator`` runs the ``overnight`` CLI."""

from coordinator.cli import main

main()
