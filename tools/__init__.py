"""Maintainers' tools beside the product: not installed (pyproject's ``packages.find`` takes only
``memascend*``), run from a checkout (``python3 -m tools.readme --write``).

``readme`` renders the measured numbers of ``README.md`` and ``docs/*.md`` from the committed
``baselines/`` (``readme_blocks`` and ``readme_caps`` hold the renderers); it imports memascend,
memascend never imports it (``tests/test_layers.py``).
"""
