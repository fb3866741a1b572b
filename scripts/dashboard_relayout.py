"""Renumber duplicate panel ids and re-flow the grid of dashboards/grafana/grpod.json.

Panels keep their order, widths and heights; each row starts a new band and the panels after
it flow left to right, wrapping at 24 columns. Run it after merging branches that each added
panels: `python scripts/dashboard_relayout.py` (tests/dashboards checks unique ids and no
overlap).
"""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards/grafana/grpod.json"


def relayout(panels: list[dict]) -> None:
    seen: set[int] = set()
    next_id = max(p["id"] for p in panels) + 1
    y = x = band = 0  # band: the height of the current line of panels
    for panel in panels:
        if panel["id"] in seen:
            panel["id"], next_id = next_id, next_id + 1
        seen.add(panel["id"])
        grid = panel["gridPos"]
        if panel["type"] == "row" or x + grid["w"] > 24:
            y, x, band = y + band, 0, 0
        grid["x"], grid["y"] = x, y
        if panel["type"] == "row":
            y, band = y + grid["h"], 0
        else:
            x, band = x + grid["w"], max(band, grid["h"])


def main() -> None:
    dash = json.loads(DASHBOARD.read_text())
    relayout(dash["panels"])
    DASHBOARD.write_text(json.dumps(dash, indent=2) + "\n")


if __name__ == "__main__":
    main()
