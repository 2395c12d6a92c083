"""Many runs from one command: launcher (the -m launcher: points, one table, one summary), check (a sweep checked
whole before its first point, and its cost), study (the Optuna study kept under runs/studies), objective (what a
point returns to the sweeper), tune (`tune=layout`: the layouts of a world size tried and ranked)."""
