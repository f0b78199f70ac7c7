"""A user's suite from `[tool.trainprobes]` (pyproject.toml or any TOML file).

See docs/audit.md for the complete schema with an example.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

TOP_KEYS = {"seed", "out", "history", "defaults", "families", "causality", "bias", "drift",
            "collectives"}


class ConfigError(ValueError):
    """A [tool.trainprobes] table that cannot be turned into a suite."""


def read_config(path) -> dict | None:
    """The [tool.trainprobes] table of a TOML file (or its top level when it has no tool table)."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {str(path)!r} is not valid TOML: {e}") from e
    if "tool" in doc:
        return doc["tool"].get("trainprobes")
    return doc


def find_config(path=None) -> tuple[dict | None, Path | None]:
    """(config, path): --config FILE, else ./pyproject.toml's table, else (None, None)."""
    if path is not None:
        cfg = read_config(path)
        if cfg is None:
            raise ConfigError(f"config {str(path)!r} has no [tool.trainprobes] table")
        return cfg, Path(path).resolve()
    here = Path("pyproject.toml")
    if here.exists():
        cfg = read_config(here)
        if cfg:
            return cfg, here.resolve()
    return None, None


def suite_from_config(cfg: dict, *, seed: int = 0, base_dir=Path("."), quick: bool = False):
    """(checks, skipped) for a [tool.trainprobes] table."""
    from probes.audit.suites import default_suite

    if not isinstance(cfg, dict):
        raise ConfigError(f"[tool.trainprobes] must be a table, got {cfg!r}")
    unknown = sorted(set(cfg) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"[tool.trainprobes] has unknown keys {unknown!r}; "
                          f"known: {sorted(TOP_KEYS)}")
    checks, skipped = [], {}
    if cfg.get("defaults"):
        checks, skipped = default_suite(seed=seed, quick=quick, families=cfg.get("families"))
    return checks, skipped
