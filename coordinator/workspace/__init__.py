"""Where a task works: its branch and worktree, what overnight commits, the tree a rule checks."""
