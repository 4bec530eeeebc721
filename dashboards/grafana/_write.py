"""Write the dashboards and the Grafana provisioning files that load them.

Layout under ``out_dir``::

    dashboards/<uid>.json                        one file per dashboard
    provisioning/dashboards/seedance.yaml        file provider pointing at dashboards/
    provisioning/datasources/seedance.yaml       the Prometheus data source the panels use

Point Grafana's ``paths.provisioning`` at ``out_dir/provisioning``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards.grafana._dashboards import DASHBOARDS

DATASOURCE_UID = "seedance-prometheus"
DATASOURCE_NAME = "Prometheus (seedance)"
FOLDER = "seedance"


def dashboard_json() -> dict[str, dict[str, object]]:
    """Every dashboard as Grafana JSON, by uid."""
    boards = [make().build() for make in DASHBOARDS]
    return {board.uid: json.loads(json.dumps(board, cls=JSONEncoder))  # type: ignore[misc]
            for board in boards}


def _provider(dashboards_dir: Path) -> dict[str, object]:
    return {"apiVersion": 1, "providers": [{
        "name": FOLDER, "folder": FOLDER, "type": "file", "disableDeletion": False,
        "allowUiUpdates": False, "updateIntervalSeconds": 30,
        "options": {"path": str(dashboards_dir), "foldersFromFilesStructure": False},
    }]}


def _datasource(prometheus_url: str) -> dict[str, object]:
    return {"apiVersion": 1, "datasources": [{
        "name": DATASOURCE_NAME, "uid": DATASOURCE_UID, "type": "prometheus", "access": "proxy",
        "url": prometheus_url, "isDefault": True, "editable": False,
        "jsonData": {"timeInterval": "15s"},
    }]}


def write_grafana(out_dir: Path | str, *, prometheus_url: str = "http://127.0.0.1:9090"
                  ) -> list[Path]:
    """Write the dashboards and provisioning files under ``out_dir``; return the paths written.

    ``prometheus_url`` is where Grafana reaches the Prometheus that scrapes the sidecar.
    """
    out = Path(out_dir).resolve()
    boards_dir = out / "dashboards"
    written: list[Path] = []
    boards_dir.mkdir(parents=True, exist_ok=True)
    for uid, board in dashboard_json().items():
        path = boards_dir / f"{uid}.json"
        path.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
        written.append(path)
    for kind, body in (("dashboards", _provider(boards_dir)),
                       ("datasources", _datasource(prometheus_url))):
        path = out / "provisioning" / kind / "seedance.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        written.append(path)
    return written
