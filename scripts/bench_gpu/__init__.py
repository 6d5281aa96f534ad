"""The GPU benchmark: `python -m scripts.bench_gpu`; what it runs and its main() are in __main__.py."""
