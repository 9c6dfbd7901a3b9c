"""Running one model across processes: tensor parallelism (`tp`)."""
