"""I/O microbenchmarks of memascend, outside the package: run from the repository root as
``python -m benchmarks.io_bench``, ``python -m benchmarks.store_e2e``; ``benchmarks.ram_loop``
makes the RAM-backed loop device both use. They import memascend; memascend never imports them."""
