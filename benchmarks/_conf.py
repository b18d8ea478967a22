"""Read a shipped config group file without Hydra (benchmarks are plain scripts)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parent.parent / "conf"


def load(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml as a dict, following a bare family name's `defaults` to its sized config."""
    data = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))
    for parent in data.pop("defaults", []):
        if parent != "_self_":
            data = {**load(group, parent), **data}
    return data
