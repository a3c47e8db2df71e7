"""`pagoda bench`: serving, offline throughput and latency benchmarks (see cli.py)."""
