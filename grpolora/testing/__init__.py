"""Real components run on one machine, shared by the tests (tests/) and the benchmarks (bench/): neither imports
the other. Nothing in the product imports this package."""
