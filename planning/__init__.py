"""What a run will need before it runs: the partition plan and the memory, time and disk estimates."""
