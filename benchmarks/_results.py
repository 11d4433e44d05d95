"""Where every benchmark's JSON goes: benchmarks/results/ (git-ignored), written the same way by each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write `result` as indented JSON to `path` (folders made as needed) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"written to {path}")
