"""A task: its file, its record and store, its states, the judge, the turn loop and its steps."""
