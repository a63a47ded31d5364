"""The bottom layer every package may import: settings, key names, connections, exit codes."""
