"""``python -m overnight`` runs the ``overnight`` CLI."""

from overnight.coordinator.cli import main

main()
