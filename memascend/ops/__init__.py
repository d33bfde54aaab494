"""Python loaders for the C++/CUDA ops under ``csrc/``.

Each op is a triplet: ``csrc/<op>/``, ``memascend/ops/<op>.py``, ``tests/ops/test_<op>.py``.
Loading goes through :func:`memascend.ops.build.load_op`.
"""
