"""Render the Helm chart offline with Helm's own engine (helm-python-sdk binds Helm's Go SDK; the
helm CLI is in neither Debian nor PyPI) and split the output into manifests."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "tokenforge"
PROFILES = ("gpu", "tp2", "cpu")


def render(profile: str, release: str = "tokenforge", namespace: str = "llm") -> list[dict]:
    import helm_python as helm

    values = yaml.safe_load((CHART / "ci" / f"{profile}-values.yaml").read_text())
    files = helm.Chart.load(str(CHART)).render(values=values, name=release, namespace=namespace, is_install=True)
    docs = []
    for name, text in sorted(files.items()):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def write_rendered(out: Path) -> list[Path]:
    """Every profile's manifests as files (for checkov); returns the paths."""
    paths = []
    for profile in PROFILES:
        for i, doc in enumerate(render(profile)):
            path = out / f"{profile}-{i:02d}-{doc['kind'].lower()}.yaml"
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            paths.append(path)
    return paths
