"""``python -m memascend.plan [REPORT.json ...]``: the planner's error on recorded runs."""

from memascend.plan.recorded import main

raise SystemExit(main())
