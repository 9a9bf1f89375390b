"""Kept for the callers that name it (tests/test_plan.py, tests/gpu_plans.py): the docs' generated
tables are bench/doc_tables.py's, one generator for every page.

    .venv/bin/python bench/scaling_tables.py     # the same as: bench/doc_tables.py --write
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_tables import BLOCKS, DENSE, MOE, main, render, tables  # noqa: E402

__all__ = ["BLOCKS", "DENSE", "MOE", "render", "tables"]

if __name__ == "__main__":
    main(["--write"])
