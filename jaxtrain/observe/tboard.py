"""Training scalars as TensorBoard event files in <run_dir>/tensorboard/ (process 0, --tensorboard).

Written with tensorboardX (the `tensorboard` extra): it writes the event format without
TensorFlow. `tensorboard --logdir <run_dir>` shows these scalars beside the profiler's traces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxtrain.errors import UserError


class ScalarWriter:
    """One scalar series per numeric record key, against the record's step."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from tensorboardX import SummaryWriter  # only when asked for: an optional extra
        except ImportError:
            raise UserError("--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'") from None
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def add(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key not in ("step", "t") and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
