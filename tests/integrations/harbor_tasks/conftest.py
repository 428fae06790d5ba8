"""Harbor task directories, not rollbox tests: their tests/ run inside the tasks' sandboxes."""

collect_ignore_glob = ["*"]
