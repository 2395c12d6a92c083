"""What a rank does while it trains, whatever the model: precision, optimizer, kernels, metrics, evaluation, signals, threads."""
