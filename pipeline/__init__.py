"""vitsweep's training and sweep pipeline: config, data, training, tracking, sweeps, CLI."""
