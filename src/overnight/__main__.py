"""``python -m overnight`` runs the ``overnight`` CLI."""

from overnight.coordinator.cli.main import main

main()
