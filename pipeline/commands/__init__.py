"""What each `quantdrift` command runs: one module per command that runs more than one stage, each listing its
stages in the order they run."""
